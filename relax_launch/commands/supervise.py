"""What an sbatch script runs after each srun (with ``cluster.max_restarts`` or
``logging.notify``): ``python -m relax_launch.commands.supervise CODE CONFIG [key=value ...]``.
It tells ``logging.notify`` how the job ended, or restarts it: for a failure that
``restarts.decide`` allows it prints the restart's console line and exits 0, and the script runs
srun again (the job resumes from its newest checkpoint: the script always passes
``checkpoint.resume=true``); otherwise it exits 1 and the script ends with srun's code.
``relax-launch run`` does the same in its own loop (``launcher.run_local``)."""

from __future__ import annotations

import sys

from relax_launch.commands.launcher import explain_failure
from relax_launch.commands.restarts import Restarts, restart_line
from relax_launch.config import load_config
from relax_launch.notify import SEND_BOUND_S, Notifier
from relax_launch.placement import plan as place
from relax_launch.run_dir import END_RECORD, EXIT_STOPPED, read_json


def main(argv: list[str]) -> int:
    """After srun ended with ``CODE``: 0 to run the job again, 1 to end (module docstring)."""
    code, config_path, overrides = int(argv[0]), argv[1], argv[2:]
    job = load_config(config_path, overrides)
    notifier = Notifier(job.logging.notify, job.name)
    record = read_json(job.log_dir / END_RECORD) or {}
    if code in (0, EXIT_STOPPED):
        event = "finished" if code == 0 else "stopped"
        notifier.send(event, f"{record.get('reason', event)} ({job.log_dir})", SEND_BOUND_S)
        return 1
    cause = record.get("reason") if record.get("state") == "failed" else None
    logs = sorted(job.log_dir.glob("torchrun-node*.log"))
    summary = "".join(path.read_text(errors="replace") for path in logs)
    cause = cause or explain_failure(place(job), summary) or f"srun exited with code {code}"
    restarts = Restarts(job, began=0.0)  # the script always resumes: every checkpoint counts
    decision = restarts.decide(cause, code)
    if decision.restart:
        line = restart_line(cause, decision, job)
        (job.log_dir / END_RECORD).unlink(missing_ok=True)  # the restarted job writes its own
        print(line, flush=True)
        notifier.send("restarted", line, SEND_BOUND_S)
        return 0
    line = f"relax-launch: job failed: {cause}; not restarted: {decision.reason}"
    print(line, flush=True)
    notifier.send("failed", line, SEND_BOUND_S)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
