"""What a resume changes in training: the settings that define the objective, recorded in every
checkpoint, compared with the config a resume is given, and said in one line before anything
starts (or refused, where a change cannot be applied exactly).

The rule (docs/reliability.md, "A resume that changes the training"): a resume applies the
config it is given. Every setting below that differs from the checkpoint's is named, old -> new,
with what it does from the resumed step on:
- the learning-rate schedule (`trainer.total_steps`, `lr`, `lr_schedule`, `lr_min_ratio`,
  `lr_warmup_steps`): the schedule is the new one, as if the campaign had been planned with it
  from the start: the line gives the learning rate at the resumed step, before and after;
- the optimizer's settings (`weight_decay`, `grad_clip`): the optimizer's moments are kept, its
  settings are the config's from the resumed step;
- the loss (`correction`, `rho`, `mask_low`, `clip_eps`, `clip_eps_high`, `minibatches`, `loss_agg`,
  `adv_norm`, `kl_coef`, `entropy_coef`, `max_staleness`, `groups_per_step`, `dynamic_sampling`): from
  the resumed step; the KL term is always against the run's anchor (its initial policy);
- sampling (`rollout.temperature`, `top_k`, `top_p`, `max_new_tokens`): trajectories started
  from then on; the trainer scores pi under the new setting.
Refused, with what to do: `trainer.group_size` (groups already admitted, in the write-ahead log,
have the old size) and a `total_steps` at or below the resumed step (nothing would train).
(The model's shape is checked by launch/prepare.py: it cannot change either.)

    settings = training_settings(cfg)                      # what a checkpoint's meta.json keeps
    line = resume_changes(saved, cfg, step=250)            # None when nothing changed
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from laminar_hpc.config.correction_specs import correction_keys

if TYPE_CHECKING:
    from laminar_hpc.config.schema import Config

SCHEDULE = ("trainer.total_steps", "trainer.lr", "trainer.lr_schedule", "trainer.lr_min_ratio",
            "trainer.lr_warmup_steps")
OPTIMIZER = ("trainer.weight_decay", "trainer.grad_clip")
# the corrections' keys (rho, mask_low, clip_eps, ...) follow from their entries (config/correction_specs.py)
LOSS = ("trainer.correction", *(f"trainer.{key}" for key in correction_keys()),
        "trainer.minibatches", "trainer.loss_agg", "trainer.adv_norm", "trainer.kl_coef", "trainer.entropy_coef",
        "trainer.max_staleness", "trainer.groups_per_step", "trainer.dynamic_sampling")
SAMPLING = ("rollout.temperature", "rollout.top_k", "rollout.top_p", "rollout.max_new_tokens")
REFUSED = {"trainer.group_size": "groups already admitted (in the write-ahead log) have the checkpoint's size"}
TRAINING_KEYS = SCHEDULE + OPTIMIZER + LOSS + SAMPLING + tuple(REFUSED)


class ResumeRefused(ValueError):
    """A resume whose config changes what cannot change: the message says what to do."""


def _get(cfg: Config, key: str) -> Any:
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


def training_settings(cfg: Config) -> dict[str, Any]:
    """The settings that define the objective, as a checkpoint's meta.json records them."""
    return {key: _get(cfg, key) for key in TRAINING_KEYS}


def _lr(settings: dict, step: int, cfg: Config) -> float:
    """The learning rate at `step` under the schedule that `settings` (dotted keys) describe."""
    values = {key.split(".")[1]: settings[key] for key in SCHEDULE if key in settings}  # older: fewer keys
    return cfg.trainer.model_copy(update=values).lr_at(step)


def resume_changes(saved: dict[str, Any] | None, cfg: Config, *, step: int) -> str | None:
    """One line naming every training setting `cfg` changes against a checkpoint of `step` whose
    settings are `saved` (None: a checkpoint from before they were recorded, nothing to compare),
    with what each does from that step; None when nothing changed. ResumeRefused for a change
    that cannot be applied (see the module's doc)."""
    if not saved:
        return None
    now = training_settings(cfg)
    changed = [k for k in TRAINING_KEYS if k in saved and saved[k] != now[k]]
    for key in changed:
        if key in REFUSED:
            raise ResumeRefused(f"cannot resume with {key}={now[key]}: the checkpoint of step {step} trained with "
                                f"{saved[key]} and {REFUSED[key]}; resume with {key}={saved[key]}, or start a new "
                                "run directory")
    if "trainer.total_steps" in changed and now["trainer.total_steps"] <= step:
        raise ResumeRefused(f"cannot resume with trainer.total_steps={now['trainer.total_steps']}: the checkpoint is "
                            f"at step {step}, so nothing would train; raise it above {step}")
    if not changed:
        return None
    parts = []
    sched = [k for k in changed if k in SCHEDULE]
    if sched:
        before, after = _lr(saved, step, cfg), _lr(now, step, cfg)
        what = (f"the learning rate at step {step} becomes {after:.3g}, was {before:.3g}: the schedule as if "
                "planned so from the start" if before != after else
                f"the learning rate at step {step} stays {after:.3g}")
        parts.append(f"{_pairs(sched, saved, now)} ({what})")
    for keys, what in ((OPTIMIZER, "the optimizer's, its moments kept"), (LOSS, "the loss's"),
                       (SAMPLING, "for trajectories started from now; pi is scored under it")):
        keys = [k for k in changed if k in keys]
        if keys:
            parts.append(f"{_pairs(keys, saved, now)} ({what})")
    return f"the resume changes the training from step {step}: " + "; ".join(parts)


def _pairs(keys: list[str], saved: dict, now: dict) -> str:
    return ", ".join(f"{k} {saved[k]} -> {now[k]}" for k in keys)
