"""Event types written to the ledger, with the fields each one carries.

Every event also has ``ev``, ``t`` (wall seconds), ``mono`` (monotonic seconds) and ``session``.
Events relayed from workers carry ``rank``; events about one attempt carry ``attempt``.
See docs/ledger.md for the full schema.
"""

from __future__ import annotations

# Run lifecycle (supervisor)
RUN_START = "run_start"  # world_size, nproc, command, config, backend
RUN_END = "run_end"  # status: completed|failed|no_progress|interrupted|max_restarts, exit_code
ATTEMPT_START = "attempt_start"  # attempt, world_size (workers spawned or standby promoted)
WORKER_READY = "worker_ready"  # attempt, rank, init_s (process group up)

# Progress (rank 0)
STEP = "step"  # step (just finished, 0-based), epoch, dt (iteration wall s), stall (ckpt stall s), loss?
EPOCH_END = "epoch_end"  # epoch, step

# Failures and recovery (supervisor unless noted)
FAILURE = "failure"  # cause: crash|hang|spike|nan|worker_exit, rank, exit_code, signal, detail, step
DETECTED = "detected"  # cause, detect_s (failure happened -> noticed)
TEARDOWN = "teardown"  # attempt, teardown_s
RESTART = "restart"  # attempt (the new one), reason
RESTORE = "restore"  # (rank 0) step, path, load_s, source: local|s3, fresh: bool
RESTORE_REJECTED = "restore_rejected"  # (rank 0) path, step, reason
ROLLBACK = "rollback"  # (supervisor) from_step, to_step, mode (replay|skip), skip_from, skip_to, abandoned
SPIKE = "spike"  # (rank 0) step, value, reason: the loss guard fired (all ranks agreed)
SKIP = "skip"  # (rank 0) skipped_from, skipped_to: batches skipped after a recurring spike
GIVE_UP = "give_up"  # reason

# Checkpoints (rank 0's checkpoint engine)
CKPT_STAGED = "ckpt_staged"  # step, stall_s, stage_s, bytes
CKPT_COMMITTED = "ckpt_committed"  # step, path, bytes, persist_s, files
CKPT_UPLOADED = "ckpt_uploaded"  # step, url, upload_s, bytes
CKPT_VERIFIED = "ckpt_verified"  # step, path, verify_s
CKPT_FAILED = "ckpt_failed"  # step, reason
CKPT_SKIPPED = "ckpt_skipped"  # step, reason (a save came due while one was in flight)
CKPT_DELETED = "ckpt_deleted"  # step, path, reason
INTERVAL = "interval"  # policy, every_steps, every_s, delta_s, mtbf_s, persist_s

# Faults injected on purpose (workers)
INJECT = "inject"  # kind, step, rank, spec

# Node health (fleet ledger, see docs/health.md)
NODE_STATE = "node_state"  # node, state, reason, check?, component, by: gpufleet|admin
HEALTH_RESULT = "health_result"  # node, plan, profile, check, status, value, unit, threshold, valid_until
