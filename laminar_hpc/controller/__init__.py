"""Controller role: prompt pool, partial-response pool, experience buffer, rollout manager."""
