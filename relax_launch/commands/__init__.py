"""What the operator runs on this machine, around a job: start it and explain how it ended
(``launcher.py``), render and submit its sbatch script (``sbatch.py``), read where it stands
(``status.py``). The ranks' own code is ``runtime/``."""
