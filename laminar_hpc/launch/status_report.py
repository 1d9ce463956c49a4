"""`laminar status RUN_DIR`: where a campaign stands, from the run directory and Slurm.

    job       1234 (slurm): RUNNING
    steps     1234.0 submitit RUNNING | 1234.1 controller-0 RUNNING | ...
    trainer   step 120/250, version 120, 812.3 trajectories/s
    ...
"""
from __future__ import annotations

import subprocess
from pathlib import Path

from laminar_hpc.metrics.progress import versions_text
from laminar_hpc.metrics.jsonl import read_steps
from laminar_hpc.metrics.status import Status, read_status
from laminar_hpc.metrics.summary import read_summary
from laminar_hpc.checkpoint_format import META_FILE
from laminar_hpc.rundir import RunDir, read_json


def slurm_steps(job_id: str) -> tuple[str, list[tuple[str, str, str]]]:
    """(job state, [(step id, step name, state)]) from squeue/sacct; '?' where Slurm says nothing."""
    def run(argv):
        try:
            return subprocess.run(argv, capture_output=True, text=True, timeout=30).stdout
        except (FileNotFoundError, subprocess.TimeoutExpired):
            return ""
    state = run(["squeue", "-h", "-j", job_id, "-o", "%T"]).strip().split("\n")[0]
    rows = []
    for line in run(["sacct", "-n", "-P", "-j", job_id, "-o", "JobID,JobName,State"]).splitlines():
        parts = line.split("|")
        if len(parts) == 3:
            rows.append((parts[0], parts[1], parts[2]))
    if not state:
        heads = [r for r in rows if "." not in r[0]]
        state = heads[0][2] if heads else "?"
    return state, rows


def elastic_line(joiners: dict[str, dict]) -> str:
    """The attach jobs and their rollouts: `job 812 (vllm-b128): rollouts 4-7 live | job 790: 2 left`."""
    jobs: dict[str, list] = {}
    for rank, j in sorted(joiners.items(), key=lambda kv: int(kv[0])):
        jobs.setdefault(str(j.get("job") or "?"), []).append((int(rank), j))
    parts = []
    for job, rows in jobs.items():
        live = [r for r, j in rows if not j.get("left")]
        kind = rows[0][1].get("kind")
        parts.append(f"job {job} ({kind}): " + (f"rollouts {','.join(map(str, live))} live" if live else "")
                     + (", " if live and len(live) < len(rows) else "")
                     + (f"{len(rows) - len(live)} left" if len(live) < len(rows) else ""))
    return " | ".join(parts)


def shards_line(shards: dict[str, dict], relayed: dict[str, int]) -> str:
    """'2: shard-0 14 partials 6 finished 0.1 MB, shard-1 ...; 4,821 frames relayed'."""
    parts = [f"{name} {v.get('partials', 0)} partials {v.get('finished', 0)} finished "
             f"{(v.get('token_bytes') or 0) / 2**20:.1f} MB" for name, v in sorted(shards.items())]
    return f"{len(shards)}: " + ", ".join(parts) + f"; {relayed.get('frames', 0):,} frames relayed"


def judges_line(rd: RunDir, st: Status, replicas: int) -> str:
    """'judge-0 ready 1,204 scored (3.1 per batch, 12 ms each, 2 unreadable), judge-1 down ...':
    each judge's liveness from the controller's role table, its counters from its own file."""
    parts = []
    for k in range(replicas):
        name = f"judge-{k}"
        entry = st.roles.get(name)
        state = "not joined" if entry is None else "down" if entry.down else "ready" if entry.ready_t else "joined"
        stats = read_json(rd.judge_stats(name)) or {}
        batches = stats.get("batches") or 0
        if batches:
            state += (f" {stats['scored']:,} scored ({stats['scored'] / batches:.1f} per batch of at most "
                      f"{stats.get('batch_size')}, {1000 * stats.get('busy_s', 0.0) / batches:.0f} ms each"
                      + (f", {stats['failed']:,} unreadable" if stats.get("failed") else "") + ")")
        parts.append(f"{name} {state}")
    return ", ".join(parts)


def newest_status(rd: RunDir) -> Status:
    """The controller's last word: status.json (every second while it runs) or controller_stats.json
    (at its end, after the last status), whichever it wrote last."""
    return max((read_status(rd.status), read_status(rd.controller_stats)), key=lambda st: st.t)


def trained(rd: RunDir, st: Status) -> tuple[int, int]:
    """(step, version) the trainer reached: the status's, or metrics.jsonl's last step row where the
    trainer wrote one after the controller's last status (a stop's final steps)."""
    rows = read_steps(rd.metrics)
    if rows and rows[-1]["step"] > st.step:
        return rows[-1]["step"], int(rows[-1].get("version", st.trainer_version))
    return st.step, st.trainer_version


def dropped_text(st: Status) -> str:
    """'1,479 prompts refused (1,479 over task.max_prompt_tokens), 3 bad rows skipped, epochs 23.50', or ''."""
    parts = []
    if st.prompts_refused:
        parts.append(f"{st.prompts_refused:,} prompts refused ({st.prompts_too_long:,} over task.max_prompt_tokens)")
    if st.rows_skipped:
        parts.append(f"{st.rows_skipped:,} bad rows skipped")
    if parts and st.epochs is not None:
        parts.append(f"epochs {st.epochs:.2f}")
    return ", ".join(parts)


def load_judge_cfg(rd: RunDir):
    """The run's task.reward.judge (None without one, or when its config no longer loads)."""
    from laminar_hpc.config import ConfigError, load_config
    try:
        return load_config(rd.config).task.reward.judge
    except (ConfigError, OSError):
        return None


def _num(v) -> str:
    return f"{v:.3f}" if isinstance(v, float) else str(v)


def status_report(run_dir: Path) -> str:
    """Reads only files (and asks Slurm); imports no torch, so it answers at once."""
    rd = RunDir.of(run_dir)
    if not rd.config.is_file():
        raise FileNotFoundError(f"{rd} is not a laminar run directory (no config.yaml)")
    lines = [f"run         {rd}"]
    job = read_json(rd.job)
    if job:
        if job.get("cluster") == "slurm":
            state, steps = slurm_steps(str(job["job_id"]))
            lines.append(f"job         {job['job_id']} (slurm): {state}")
            if steps:
                lines.append("steps       " + " | ".join(f"{i} {n} {s}" for i, n, s in steps))
        else:
            lines.append(f"job         {job['job_id']} ({job.get('cluster')})")
    st = newest_status(rd)
    summary = read_summary(rd)
    ended = summary if summary and summary.get("run_id") == rd.run_id else None  # the last start's end
    if st.t:  # written at least once
        total = "?" if st.total_steps is None else st.total_steps
        step, version = trained(rd, st)
        phase = f"ended: {ended.get('outcome')}" if ended else f"phase {st.phase}"
        lines.append(f"trainer     step {step}/{total}, version {version}, "
                     f"{st.trajectories_per_s:.1f} trajectories/s ({phase})")
        lines.append(f"relays      {versions_text(st.relay_versions)}")  # 'v6 x2': two relays hold version 6
        lines.append(f"rollouts    {versions_text(st.rollout_versions)}")
        judge = load_judge_cfg(rd)
        if judge is not None:  # task.reward.judge: each judge's state and what it scored
            lines.append("judges      " + judges_line(rd, st, judge.replicas))
        if st.shards:  # stream shards (controller.shards): what each holds, as it last reported
            lines.append("shards      " + shards_line(st.shards, st.relayed))
        if st.elastic:
            lines.append("elastic     " + elastic_line(st.elastic))
        if dropped := dropped_text(st):
            lines.append(f"dropped     {dropped}")
    jobs = (read_json(rd.elastic_jobs) or {}).get("jobs") or []
    if jobs:  # slurm.elastic's attach jobs (launch/attach_jobs.py), as the campaign driver last saw them
        lines.append("elastic jobs " + " | ".join(f"{j.get('job_id')} {j.get('state')}" for j in jobs[-6:]))
    ckpts = rd.checkpoints()
    if ckpts:
        meta = read_json(ckpts[-1] / META_FILE) or {}
        lines.append(f"checkpoint  {ckpts[-1]} (step {meta.get('step')}, version {meta.get('version')})")
    else:
        lines.append("checkpoint  none yet")
    if summary:
        lines.append(f"last end    {summary.get('outcome')}: {summary.get('train_steps')} steps, reward "
                     f"{_num(summary.get('reward_first'))} -> {_num(summary.get('reward_last'))}, "
                     f"wall {summary.get('wall_s', 0):.0f}s")
    lines.append(f"starts      {len(rd.starts())}")
    return "\n".join(lines)
