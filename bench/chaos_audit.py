"""The chaos benchmark's audits and report, read from the ledger, the store and the receiver.

Audits (each failure is a sentence in the returned list):

* every job SUCCEEDED;
* never two live leases for one job: per job, leases by epoch are 1..n, each ended before the
  next was granted, and one LEASE_GRANTED event per (job, epoch);
* every epoch used once: checkpoint keys carry their own epoch (`<step>-e<epoch>`), every
  committed checkpoint was announced under the lease of that epoch, and the result key is the
  final epoch's;
* steps lost per interruption (the furthest step the ledger saw a lease reach, by its last
  heartbeat or a commit, minus the checkpoint the next lease resumed from) at most the lease's
  checkpoint interval plus the steps the job ran in one lease TTL;
* every result's sha256 equals the fault-free in-process run's;
* nothing left in storage beyond retention: no checkpoint object of a finished job, no object
  outside the uploads and the results;
* every webhook delivered, each delivery under one id, every id received by the receiver;
* with the planned kills (not `--mtbi-s`), at least 10% of jobs interrupted and 1% three times.

Besides the audits the report counts what checkpointing cost and what interruptions destroyed
(checkpoints taken and steps lost, in training seconds at the simulated pace and stall), which
`--compare-intervals` sets side by side for a fixed interval and `auto`.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg


@dataclass(frozen=True)
class Expected:
    by_index: dict[int, str]


def _stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    return {
        "mean": round(statistics.fmean(values), 2),
        "median": round(statistics.median(values), 2),
        "min": round(min(values), 2),
        "max": round(max(values), 2),
    }


def stored_keys(root: Path) -> list[str]:
    """Every object key in the local store (its files; dot-files are its temporaries)."""
    return [
        str(p.relative_to(root))
        for p in root.rglob("*")
        if p.is_file() and not p.name.startswith(".")
    ]


async def audit_and_report(
    *,
    url: str,
    settings: dict[str, Any],
    job_ids: list[str],
    expected: Expected,
    objects_root: Path,
    webhooks: list[tuple[str, str, str, int]],
    webhooks_refused: int,
    faults: dict[str, Any],
    http_faults: dict[str, int],
    scaler_actions: list[tuple[float, str, str, str]],
    all_finished: bool,
    run_seconds: float,
    replica_exit_codes: list[int | None],
) -> tuple[dict[str, Any], list[str]]:
    failures: list[str] = []
    conn = await asyncpg.connect(url)
    try:
        jobs = {
            str(r["job_id"]): r
            for r in await conn.fetch(
                "SELECT *, lorafleet_gpu_seconds(job_id) AS gpu_s FROM jobs WHERE owner = 'bench'"
            )
        }
        leases = await conn.fetch("SELECT * FROM leases ORDER BY job_id, epoch")
        events = await conn.fetch(
            "SELECT job_id::text AS job_id, kind, at, machine_id, lease_id::text AS lease_id,"
            " epoch, step, failure_class, message FROM job_events ORDER BY event_id"
        )
        checkpoints = await conn.fetch("SELECT * FROM checkpoints")
        deliveries = await conn.fetch("SELECT * FROM webhook_deliveries")
    finally:
        await conn.close()

    interval = int(settings["interval"])
    index_of = {job_id: i for i, job_id in enumerate(job_ids)}

    # Outcomes.
    states = Counter(r["state"] for r in jobs.values())
    if not all_finished:
        failures.append(f"not every job finished within {settings['timeout_s']} s: {dict(states)}")
    for job_id, row in jobs.items():
        if row["state"] != "SUCCEEDED":
            failures.append(f"job {job_id} ended {row['state']}: {row['error']}")

    # Leases: never two live, each epoch once.
    by_job: dict[str, list[asyncpg.Record]] = defaultdict(list)
    for lease in leases:
        by_job[str(lease["job_id"])].append(lease)
    granted = Counter((e["job_id"], e["epoch"]) for e in events if e["kind"] == "LEASE_GRANTED")
    for key, count in granted.items():
        if count > 1:
            failures.append(f"job {key[0]} epoch {key[1]} granted {count} times")
    for job_id, job_leases in by_job.items():
        epochs = [int(lease["epoch"]) for lease in job_leases]
        if epochs != list(range(1, len(epochs) + 1)):
            failures.append(f"job {job_id}: lease epochs {epochs} are not 1..n")
        for earlier, later in itertools.pairwise(job_leases):
            if earlier["ended_at"] is None or earlier["ended_at"] > later["granted_at"]:
                failures.append(
                    f"job {job_id}: epoch {earlier['epoch']} still live when epoch"
                    f" {later['epoch']} was granted"
                )
        if job_leases and job_leases[-1]["ended_at"] is None:
            failures.append(f"job {job_id}: lease epoch {job_leases[-1]['epoch']} never ended")
    lease_of = {(str(r["job_id"]), int(r["epoch"])): str(r["lease_id"]) for r in leases}
    for event in events:
        if event["kind"] == "CHECKPOINT_COMMITTED" and (
            lease_of.get((event["job_id"], event["epoch"])) != event["lease_id"]
        ):
            failures.append(
                f"job {event['job_id']}: checkpoint at step {event['step']} committed"
                f" under a lease that is not epoch {event['epoch']}'s"
            )
    for cp in checkpoints:
        if not str(cp["key"]).endswith(f"/{cp['step']}-e{cp['epoch']}"):
            failures.append(f"checkpoint key {cp['key']} does not name step and epoch")
    for job_id, row in jobs.items():
        if row["result_key"] and f"/e{row['epoch']}/" not in row["result_key"]:
            failures.append(f"job {job_id}: result {row['result_key']} not of epoch {row['epoch']}")

    # Steps lost per interruption: what the ledger had seen minus where the next lease resumed.
    committed: dict[str, list[tuple[Any, int]]] = defaultdict(list)
    for cp in checkpoints:
        committed[str(cp["job_id"])].append((cp["committed_at"], int(cp["step"])))
    reached: dict[tuple[str, int], int] = defaultdict(int)
    for e in events:
        if e["kind"] in ("HEARTBEAT", "CHECKPOINT_COMMITTED") and e["step"] is not None:
            key = (e["job_id"], int(e["epoch"]))
            reached[key] = max(reached[key], int(e["step"]))
    pace = [float(r["progress_s_per_step"]) for r in jobs.values() if r["progress_s_per_step"]]
    s_per_step = statistics.median(pace) if pace else float(settings["step_s"])
    ttl_steps = math.ceil(float(settings["lease_ttl_s"]) / max(s_per_step, 1e-6))
    # With auto, each lease's own interval, as the scheduler chose it at the grant and put it on
    # the job's timeline ("checkpointing every N steps (auto, ...)").
    chosen_by_lease = {
        (e["job_id"], int(e["epoch"])): int(e["message"].split()[2])
        for e in events
        if e["kind"] == "NOTICE" and (e["message"] or "").startswith("checkpointing every ")
    }
    max_steps = int(settings["steps"])

    def interval_of(job_id: str, epoch: int) -> int:
        return chosen_by_lease.get((job_id, epoch), interval or max_steps)

    def resumed_at(job_id: str, granted_at: Any) -> int:
        """The checkpoint a lease granted then resumed from: the latest committed before."""
        return max((step for at, step in committed[job_id] if at <= granted_at), default=0)

    def seen(job_id: str, lease: asyncpg.Record) -> int:
        """The furthest a lease got as the ledger saw it: its commits, and its last heartbeat
        (the lease row keeps it; the timeline keeps only some heartbeats)."""
        return max(reached.get((job_id, int(lease["epoch"])), 0), lease["last_step"] or 0)

    lost: list[int] = []
    # Per interruption: the interval of the lease that was interrupted.
    lost_intervals: list[int] = []
    end_reasons: Counter[str] = Counter()
    for job_id, job_leases in by_job.items():
        for earlier, later in itertools.pairwise(job_leases):
            end_reasons[str(earlier["end_reason"])] += 1
            lease_interval = interval_of(job_id, int(earlier["epoch"]))
            bound = lease_interval + ttl_steps
            reach = seen(job_id, earlier)
            resumed = resumed_at(job_id, later["granted_at"])
            lost.append(max(0, reach - resumed))
            lost_intervals.append(lease_interval)
            if reach - resumed > bound:
                failures.append(
                    f"job {job_id}: {reach - resumed} steps lost before epoch {later['epoch']}"
                    f" (bound {bound}: its lease's interval plus one lease TTL of steps)"
                )
    chosen = list(chosen_by_lease.values())
    # The checkpoint cost each auto lease's worker reported (stall plus upload), from the same
    # notices: what one checkpoint costs on this fleet, whatever the interval.
    reported_costs = [
        float(e["message"].split("checkpoint cost ")[1].split()[0])
        for e in events
        if e["kind"] == "NOTICE"
        and "(reported by the worker)" in (e["message"] or "")
        and "checkpoint cost " in (e["message"] or "")
    ]
    committed_count = sum(1 for e in events if e["kind"] == "CHECKPOINT_COMMITTED")
    # Checkpoints taken, committed or not (each stalled training): per lease, the multiples of
    # its interval past the step it resumed from, up to how far it got (a finished lease: up to
    # the last step, which is the result, not a checkpoint).
    snapshots_taken = 0
    for job_id, job_leases in by_job.items():
        finished_job = jobs[job_id]["state"] == "SUCCEEDED"
        for i, lease in enumerate(job_leases):
            every = interval_of(job_id, int(lease["epoch"]))
            start = resumed_at(job_id, lease["granted_at"])
            finished_here = finished_job and i == len(job_leases) - 1
            end = max_steps - 1 if finished_here else min(seen(job_id, lease), max_steps - 1)
            snapshots_taken += max(0, end // every - start // every)
    step_s = float(settings["step_s"])
    training_s_lost = sum(lost) * step_s
    training_s_checkpointing = snapshots_taken * float(settings.get("checkpoint_stall_s") or 0.0)

    # Results against the fault-free runs.
    mismatched = 0
    for job_id, row in jobs.items():
        want = expected.by_index.get(index_of.get(job_id, -1))
        if row["state"] == "SUCCEEDED" and row["result_sha256"] != want:
            mismatched += 1
            failures.append(
                f"job {job_id} (#{index_of.get(job_id)}): result sha256 {row['result_sha256']}"
                f" != fault-free {want}"
            )

    # Storage after the run.
    left = stored_keys(objects_root)
    results = {str(r["result_key"]) for r in jobs.values() if r["result_key"]}
    stray = [k for k in left if not k.startswith("uploads/") and k not in results]
    checkpoint_objects = [k for k in stray if "/checkpoints/" in k]
    if stray:
        failures.append(
            f"{len(stray)} objects left in storage beyond retention"
            f" ({len(checkpoint_objects)} checkpoints), e.g. {sorted(stray)[:3]}"
        )
    live_rows = [cp for cp in checkpoints if cp["deleted_at"] is None]
    if live_rows:
        failures.append(f"{len(live_rows)} checkpoints of finished jobs not deleted in the ledger")

    # Webhooks.
    received_ids = Counter(d for d, *_ in webhooks)
    ids_per_event: dict[tuple[str, int], set[str]] = defaultdict(set)
    for delivery_id, _, job_id, event_id in webhooks:
        ids_per_event[(job_id, event_id)].add(delivery_id)
    for key, ids in ids_per_event.items():
        if len(ids) > 1:
            failures.append(f"webhook for job {key[0]} event {key[1]} came with ids {sorted(ids)}")
    for d in deliveries:
        if d["delivered_at"] is None:
            failures.append(f"webhook delivery {d['delivery_id']} not delivered: {d['last_error']}")
        elif str(d["delivery_id"]) not in received_ids:
            failures.append(f"webhook delivery {d['delivery_id']} marked delivered, never received")
    succeeded_hooks = Counter(str(d["job_id"]) for d in deliveries if d["event"] == "succeeded")
    for job_id, row in jobs.items():
        if row["state"] == "SUCCEEDED" and succeeded_hooks[job_id] != 1:
            failures.append(f"job {job_id}: {succeeded_hooks[job_id]} 'succeeded' webhooks")

    # The report, in the terms of the system lorafleet replaces.
    finished = [r for r in jobs.values() if r["finished_at"] is not None]
    first_grant = {
        job_id: min(lease["granted_at"] for lease in job_leases)
        for job_id, job_leases in by_job.items()
    }
    time_per_job = [
        (r["finished_at"] - first_grant[str(r["job_id"])]).total_seconds()
        for r in finished
        if str(r["job_id"]) in first_grant
    ]
    submit_to_done = [(r["finished_at"] - r["created_at"]).total_seconds() for r in finished]
    nodes_needed = Counter(
        len({lease["machine_id"] for lease in by_job.get(job_id, [])}) for job_id in jobs
    )
    leases_per_job = Counter(len(by_job.get(job_id, [])) for job_id in jobs)
    n = max(len(jobs), 1)
    interrupted = sum(c for k, c in leases_per_job.items() if k >= 2)
    thrice = sum(c for k, c in leases_per_job.items() if k >= 4)
    # The planned kills must have happened (memoryless kills fall where they fall).
    if not settings.get("mtbi_s") and interrupted / n < 0.10:
        failures.append(f"the plan interrupted only {interrupted / n:.1%} of jobs (< 10%)")
    if not settings.get("mtbi_s") and thrice / n < 0.01:
        failures.append(f"only {thrice / n:.1%} of jobs were interrupted 3+ times (< 1%)")
    gpu_seconds = sum(float(r["gpu_s"]) for r in jobs.values())
    node_faults = [
        e for e in events if e["kind"] == "ATTEMPT_FAILED" and e["failure_class"] == "NODE"
    ]
    bad_machine = faults.get("bad_machine", "")
    bad_realloc = [a for a in scaler_actions if a[1] == "reallocate"]
    if bad_machine and not bad_realloc:
        failures.append(f"the bad node {bad_machine} was never reallocated by the scaler")
    kills = faults.get("kills", [])
    report: dict[str, Any] = {
        "settings": {k: v for k, v in settings.items() if k not in ("workdir", "keep")},
        "jobs_succeeded": f"{states.get('SUCCEEDED', 0)} of {len(job_ids)}",
        "states": dict(states),
        "run_seconds": round(run_seconds, 1),
        "time_per_job_s (first grant to result)": _stats(time_per_job),
        "time_per_job_s (submit to result)": _stats(submit_to_done),
        "share_of_jobs_by_nodes_needed": {
            str(k): f"{c / n:.1%}" for k, c in sorted(nodes_needed.items())
        },
        "share_of_jobs_by_leases": {
            str(k): f"{c / n:.1%}" for k, c in sorted(leases_per_job.items())
        },
        "jobs_interrupted": f"{interrupted} ({interrupted / n:.1%})",
        "jobs_interrupted_3_or_more_times": f"{thrice} ({thrice / n:.1%})",
        "gpu_seconds": round(gpu_seconds, 1),
        "cost_usd": round(gpu_seconds / 3600 * float(settings["price_per_gpu_hour"]), 4),
        "price_per_gpu_hour_usd": settings["price_per_gpu_hour"],
        "manual_actions": 0,
        "lease_ends_before_a_new_lease": dict(end_reasons),
        "checkpoint_interval": interval or "auto",
        "intervals_chosen (auto, per lease)": _stats([float(x) for x in chosen]),
        "checkpoints_committed": committed_count,
        "checkpoints_per_job": round(committed_count / n, 2),
        "checkpoint_cost_reported_s (auto leases)": _stats(reported_costs),
        "checkpoint_snapshots_taken": snapshots_taken,
        "steps_lost_total": sum(lost),
        # The two terms checkpointing_steps auto trades (Young-Daly), in training seconds at the
        # simulated pace: steps redone after interruptions, and checkpoint stalls.
        "training_s_lost": round(training_s_lost, 2),
        "training_s_checkpointing": round(training_s_checkpointing, 2),
        "training_s_lost_plus_checkpointing": round(training_s_lost + training_s_checkpointing, 2),
        "steps_lost_per_interruption": {
            "count": len(lost),
            **_stats([float(x) for x in lost]),
            "bound": "the lease's interval + steps in one lease TTL (" + str(ttl_steps) + ")",
            "over_one_interval": sum(1 for x, i in zip(lost, lost_intervals, strict=True) if x > i),
            "over_two_intervals": sum(
                1 for x, i in zip(lost, lost_intervals, strict=True) if x > 2 * i
            ),
            "histogram_by_intervals": {
                f"<={k + 1} intervals": c
                for k, c in sorted(
                    Counter(
                        max(0, x - 1) // i for x, i in zip(lost, lost_intervals, strict=True)
                    ).items()
                )
            },
        },
        "faults": {
            "worker_sigkills": sum(1 for k in kills if k["signal"] == "SIGKILL"),
            "worker_sigterms": sum(1 for k in kills if k["signal"] == "SIGTERM"),
            "stream_cuts": faults.get("cuts", 0),
            "storage_requests": http_faults,
            "scheduler_replica_killed": faults.get("replica_killed_at") is not None,
            "postgres_restarted": faults.get("postgres_restarted_at") is not None,
            "bad_node": bad_machine,
            "node_fault_attempts": len(node_faults),
            "webhook_receiver_refusals": webhooks_refused,
        },
        "scaler_actions": Counter(a[1] for a in scaler_actions),
        "scaler_reallocations": [a[2] + ": " + a[3] for a in bad_realloc][:5],
        "results_matching_fault_free_sha256": f"{len(jobs) - mismatched} of {len(jobs)}",
        "objects_left": {"uploads_and_results": len(left) - len(stray), "stray": len(stray)},
        "webhooks": {"deliveries": len(deliveries), "received_requests": len(webhooks)},
        "replica_exit_codes": replica_exit_codes,
        "audits_failed": len(failures),
    }
    if faults.get("scaler_error"):
        failures.append(f"the scaler stopped: {faults['scaler_error']}")
    if not faults.get("replica_killed_at"):
        failures.append("the plan never killed a scheduler replica")
    if not faults.get("postgres_restarted_at"):
        failures.append("the plan never restarted Postgres")
    return report, failures
