"""relax-launch: RL post-training of LLMs as one torchrun job."""

__version__ = "0.1.0"
