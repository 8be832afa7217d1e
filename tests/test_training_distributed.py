"""Two processes through ``accelerate launch`` on CPU (gloo), and Accelerate's batch sharding."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import hdla_vision  # noqa: F401  (registers the timm models)
import pytest
from accelerate.data_loader import prepare_data_loader
from accelerate.state import AcceleratorState
from timm.data.distributed_sampler import RepeatAugSampler
from torch.utils.data import DataLoader

from hdla_vision.training.data import EpochOrder
from hdla_vision.training.records import read_metrics
from tests.training_helpers import REPO, tiny_config_dict, tiny_dataset, write_config


class _IndexOf:
    """A dataset whose item ``(index, seed)`` is ``index``."""

    def __getitem__(self, key):
        return key[0]


def _shard(order: EpochOrder, rank: int) -> list[int]:
    """The sample indices Accelerate gives process ``rank`` of 2 from ``order``."""
    loader = DataLoader(_IndexOf(), batch_size=order.batch_per_process, sampler=order, drop_last=True,
                        collate_fn=list)
    AcceleratorState._reset_state(reset_partial_state=True)
    sharded = prepare_data_loader(loader, num_processes=2, process_index=rank, put_on_device=False)
    return [index for batch in sharded for index in batch]


def test_accelerate_shards_the_epoch_order_disjointly():
    order = EpochOrder(40, batch_per_process=4, num_processes=2, seed=0)
    order.use_epoch(5)
    first, second = _shard(order, 0), _shard(order, 1)
    assert len(first) == len(second) == 20
    assert not set(first) & set(second)
    assert sorted(first + second) == sorted(i for i, _ in order)


def test_repeated_augmentation_shards_match_timm_repeat_aug_sampler():
    """After Accelerate's sharding, process r sees exactly what DeiT's sampler gives rank r."""
    order = EpochOrder(40, batch_per_process=4, num_processes=2, seed=0, repeated_aug=True, num_repeats=3)
    order.use_epoch(2)
    for rank in (0, 1):
        timm_sampler = RepeatAugSampler(range(40), num_replicas=2, rank=rank, num_repeats=3)
        timm_sampler.set_epoch(2)
        expected = list(timm_sampler)
        got = _shard(order, rank)
        assert got == expected[: len(got)] and len(got) == len(expected) // 4 * 4


def test_two_process_cpu_run_agrees(tmp_path):
    """``accelerate launch --multi_gpu --num_processes 2`` with ACCELERATE_USE_CPU: gloo on CPU."""
    data_dir = tiny_dataset(tmp_path / "cache")
    values = tiny_config_dict(data_dir, sched={"epochs": 1, "warmup_epochs": 0})
    config = write_config(tmp_path / "two.yaml", values)
    out = tmp_path / "run"
    env = dict(os.environ, ACCELERATE_USE_CPU="1", OMP_NUM_THREADS="1")
    # `python -m accelerate.commands.launch` is the `accelerate launch` CLI; with --multi_gpu and
    # ACCELERATE_USE_CPU it starts two gloo processes (`--cpu` alone starts one without MPI).
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
               "--main_process_port", str(29500 + os.getpid() % 1000),
               str(REPO / "train_imagenet.py"), "--config", str(config), "--output-dir", str(out)]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "2 process(es) x 4 images" in result.stdout
    final = json.loads((out / "final.json").read_text())
    checksums = final["param_checksum_per_process"]
    assert len(checksums) == 2 and checksums[0] == checksums[1]
    row = read_metrics(out / "metrics.jsonl")[0]
    assert row["images_per_process"] == [28, 28]  # global batch 8 split 4 + 4, 7 steps
    assert row["distinct_samples"] == 56  # disjoint shards
    assert (out / "checkpoints" / "step_00000007" / "random_states_1.pkl").is_file()


@pytest.mark.parametrize("repeated_aug", [False, True])
def test_process_indices_are_what_accelerate_hands_each_process(repeated_aug):
    """A mid-epoch resume recomputes the samples each process trained on before the checkpoint."""
    order = EpochOrder(40, batch_per_process=4, num_processes=2, seed=1, repeated_aug=repeated_aug)
    order.use_epoch(3)
    for rank in (0, 1):
        shard = _shard(order, rank)
        for batches in (0, 1, 3, 5):
            assert order.process_indices(rank, batches) == shard[: 4 * batches]
