"""The CPU quickstart (configs/quickstart_cpu.yaml) written with the Python API."""

from base import quickstart

config = quickstart("quickstart-cpu")
