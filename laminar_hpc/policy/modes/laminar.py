"""laminar: trajectory-level asynchrony. Each rollout takes new weights on its own, from its
node's relay (policy/refresh.py: `rollout.refresh_in_flight` picks whether it drains first
or loads in flight); admission is continuous; no replica waits for another."""
from __future__ import annotations

from laminar_hpc.policy.modes.base import Mode, T, WaysToTakeWeights


class Laminar(Mode):
    name = "laminar"
    meaning = "trajectory-level asynchrony: each replica takes new weights alone from its relay, repack"

    def take_weights(self, ways: WaysToTakeWeights[T]) -> T:
        return ways.per_replica()

    @property
    def admits_joiners(self) -> bool:
        return True  # each replica takes weights alone: one more or less changes no one's wait

    def repacks(self, *, enabled: bool, refresh: str) -> bool:
        """Only a replica that drains for weights gains from repack; refreshing in flight with
        `always`, no replica ever drains, and a move would only cost its destination a re-prefill."""
        return enabled and refresh != "always"

    def starts_on_newest(self, refresh: str) -> bool:
        """Refreshing in flight (`always`): a replica switches within a second of its relay getting
        the version, so work started just before counts a version staler for nothing. Not with
        `underfull`: such a replica does not switch while its batch is full enough, so its free
        slots would idle for the whole hold; pure laminar drains first."""
        return refresh == "always"

    def pins_versions(self, refresh: str) -> bool:
        """Pure laminar (`never`): one version per trajectory. Refreshing in flight, a trajectory
        records the version of each token span instead."""
        return refresh == "never"
