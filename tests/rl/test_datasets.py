"""Prompt data from files: JSONL, Parquet, an HF ``datasets`` directory (save_to_disk's Arrow
files, one split or a DatasetDict) and the Hub's Parquet layout, with key mapping; bad data and
reward functions refused by ``relax-launch run`` before any process starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from relax_launch.config import ConfigError
from relax_launch.rl.config import RewardConfig, RewardSource
from relax_launch.rl.data import load_prompts
from relax_launch.rl.data_config import DataConfig
from relax_launch.rl.inputs import read_inputs

ROWS = [
    {"question": "What is 2 + 3?", "answer": 5, "data_source": "math"},
    {"question": "Name a colour.", "answer": None, "data_source": "open"},
]
CHATS = [
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]}
]
CLI = str(Path(sys.executable).with_name("relax-launch"))
TINY = Path(__file__).parent / "loss_family_tiny.yaml"


def save_to_disk(directory: Path, rows: list[dict]) -> Path:
    """The layout ``datasets.Dataset.save_to_disk`` writes: Arrow stream files and state.json."""
    directory.mkdir(parents=True)
    table = pa.Table.from_pylist(rows)
    with pa.OSFile(str(directory / "data-00000-of-00001.arrow"), "wb") as sink:
        with pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
    state = {"_data_files": [{"filename": "data-00000-of-00001.arrow"}], "_split": None}
    (directory / "state.json").write_text(json.dumps(state))
    (directory / "dataset_info.json").write_text("{}")
    return directory


def test_parquet_with_key_mapping(tmp_path):
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), path)
    prompts = load_prompts(DataConfig(dataset=str(path), prompt_key="question", label_key="answer"))
    assert [p.messages[0]["content"] for p in prompts] == ["What is 2 + 3?", "Name a colour."]
    assert [(p.label, p.data_source) for p in prompts] == [("5", "math"), (None, "open")]


def test_chat_rows_keep_every_turn(tmp_path):
    path = tmp_path / "chat.parquet"
    pq.write_table(pa.Table.from_pylist(CHATS), path)
    (prompt,) = load_prompts(DataConfig(dataset=str(path)))
    assert [m["role"] for m in prompt.messages] == ["system", "user"]


def test_save_to_disk_directories_one_split_or_a_dataset_dict(tmp_path):
    single = save_to_disk(tmp_path / "single", ROWS)
    mapping = {"prompt_key": "question", "label_key": "answer"}
    assert len(load_prompts(DataConfig(dataset=str(single), **mapping))) == 2
    both = tmp_path / "dict"
    save_to_disk(both / "train", ROWS)
    save_to_disk(both / "test", ROWS[:1])
    (both / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    assert len(load_prompts(DataConfig(dataset=str(both), split="test", **mapping))) == 1
    with pytest.raises(ValueError, match=r"data.split='dev' is not in .*\['train', 'test'\]"):
        load_prompts(DataConfig(dataset=str(both), split="dev", **mapping))


def test_hub_parquet_layout_picks_the_split(tmp_path):
    (tmp_path / "data").mkdir()
    table = pa.Table.from_pylist([{"prompt": f"p{i}"} for i in range(3)])
    pq.write_table(table, tmp_path / "data" / "train-00000-of-00001.parquet")
    pq.write_table(table.slice(0, 1), tmp_path / "data" / "test-00000-of-00001.parquet")
    assert len(load_prompts(DataConfig(dataset=str(tmp_path)))) == 3
    assert len(load_prompts(DataConfig(dataset=str(tmp_path), split="test"))) == 1


def test_a_row_without_the_fields_names_itself_and_the_fix(tmp_path):
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), path)
    with pytest.raises(
        ValueError, match=r"d.parquet row 1: .*fields: question, answer.*prompt_key"
    ):
        load_prompts(DataConfig(dataset=str(path)))
    garbage = tmp_path / "garbage.parquet"
    garbage.write_text("not parquet")
    with pytest.raises(ValueError, match="cannot read .*garbage.parquet"):
        load_prompts(DataConfig(dataset=str(garbage)))


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"dataset": "builtin:arithmetic", "prompt_key": "q"}, "data.prompt_key names fields"),
        ({"dataset": "x.jsonl", "split": "test"}, "x.jsonl is one file: remove data.split"),
        ({"dataset": "x.csv"}, "neither builtin:NAME"),
    ],
)
def test_settings_the_data_would_not_use_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        DataConfig(**fields)


def test_read_inputs_names_the_reward_function_that_does_not_import(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "hi"}\n')
    data = DataConfig(dataset=str(path))
    rewards = RewardConfig(sources=(RewardSource(name="a", function="builtin:exact_numeric"),))
    assert len(read_inputs(data, rewards).prompts) == 1
    broken = RewardConfig(sources=(RewardSource(name="a", function="no_such_module:score"),))
    with pytest.raises(ConfigError, match=r"reward.sources\[0\].function: .*no_such_module"):
        read_inputs(data, broken)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["data.dataset=BAD"], "bad.jsonl:1: needs a non-empty 'prompt'"),
        (['reward.sources=[{name: a, function: "no_such_module:f"}]'], "no_such_module"),
    ],
)
def test_run_refuses_bad_data_and_rewards_before_starting(tmp_path, overrides, message):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "hi"}\n')
    args = [o.replace("BAD", str(bad)) for o in overrides] + [
        "genrm=null",
        "cluster.nproc_per_node=3",
    ]
    result = subprocess.run(
        [CLI, "run", str(TINY), *args, f"logging.dir={tmp_path / 'logs'}"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(TINY.parent)},  # the config's reward module
    )
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "logs").exists()
