"""Tool-use episodes: the environment interface, the tool-call format and transcripts
(`episode.py`), episodes played outside a rollout (`episode_play.py`), the tools and environments
a config's `env:` names (`loader.py`) and the calculator tool. The python tool runs in
tasks/sandbox/."""
