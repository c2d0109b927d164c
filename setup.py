"""relax-launch: RL post-training of LLMs as one torchrun job.

Versions are pinned in requirements/pins.txt and applied as a constraint by
scripts/bootstrap.sh; this file names dependencies only.
"""

from setuptools import find_packages, setup

# SGLang itself is installed with --no-deps (its metadata pins a CUDA torch); these are the
# dependencies its CPU engine, HTTP server and Llama models actually import.
SGLANG_CPU_DEPS = [
    "transformers",
    "tokenizers",
    "xgrammar",
    "openai",
    "compressed-tensors",
    "sentencepiece",
    "soundfile",
    "apache-tvm-ffi",
    "numpy",
    "safetensors",
    "fastapi",
    "uvicorn",
    "uvloop",
    "pyzmq",
    "orjson",
    "msgspec",
    "psutil",
    "requests",
    "setproctitle",
    "python-multipart",
    "prometheus-client",
    "xxhash",
    "pybase64",
    "partial_json_parser",
    "einops",
    "aiohttp",
    "pillow",
    "triton",
    "IPython",
    "dill",
    "zstandard",
    "gguf",
    "jsonschema",
]
# httptools: the gateway's HTTP parser (uvicorn falls back to the slower h11 without it).
# rich: the operator's console (progress with ETA); psutil: finding the processes a job started.
RUNTIME_DEPS = ["torch", "megatron-core", "sglang-router", "httptools", "accelerate"]
RUNTIME_DEPS += ["rich", "psutil"]
# The gateway (rank 0): FastAPI on Starlette, prometheus_client metrics; aiohttp: the package's
# one HTTP client (relax_launch/http.py).
RUNTIME_DEPS += ["fastapi", "starlette", "aiohttp", "prometheus-client"]
# tensorboard: event files (torch.utils.tensorboard); matplotlib: curves.png; wandb: logging.wandb.
RUNTIME_DEPS += ["tensorboard", "matplotlib", "wandb"]
# pyarrow: Parquet files and HF `datasets` directories as data.dataset (no `datasets` needed).
RUNTIME_DEPS += ["pyarrow"]
# apprise: logging.notify (Slack, email, webhooks, ... from one URL each).
RUNTIME_DEPS += ["apprise"]
# reasoning-gym: procedural tasks as data.dataset (no downloads); math-verify with the ANTLR
# runtime its LaTeX parser needs: the math_verify reward.
RUNTIME_DEPS += ["reasoning-gym", "math-verify[antlr4_13_2]"]
# Mooncake's transfer engine moves KV caches between prefill and decode engines (its build
# without CUDA here, SGLang's own choice on GPUs).
MOONCAKE = {"cpu": ["mooncake-transfer-engine-non-cuda"], "gpu": ["mooncake-transfer-engine"]}

setup(
    name="relax-launch",
    version="0.1.0",
    description="RL post-training of LLMs (GRPO, distillation, GenRM) as one torchrun job",
    packages=find_packages(include=["relax_launch", "relax_launch.*"]),
    package_data={"relax_launch.platform": ["stand_ins/*/*.py"]},
    python_requires=">=3.11",
    install_requires=["click", "pydantic", "pyyaml", "pillow"],
    extras_require={
        "cpu": RUNTIME_DEPS + SGLANG_CPU_DEPS + MOONCAKE["cpu"],
        "gpu": RUNTIME_DEPS + ["sglang"] + MOONCAKE["gpu"],
        # httpx: the tests' and benchmarks' own client, independent of the package's
        # peft: the tests load a LoRA run's adapter export as a PEFT model
        "test": [
            "pytest",
            "pytest-asyncio",
            "pytest-timeout",
            "pytest-xdist",
            "ruff",
            "schemathesis",
            "httpx",
        ]
        + ["peft"],
    },
    entry_points={
        "console_scripts": ["relax-launch=relax_launch.cli:main"],
        # Loaded by SGLang in its processes: in-place receive for weight sync.
        "sglang.srt.plugins": ["relax_launch_weights=relax_launch.weights.receiver:register"],
    },
)
