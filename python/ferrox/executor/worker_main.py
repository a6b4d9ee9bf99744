"""A tensor-parallel rank other than the driver: load its shard, then run every step the driver
broadcasts until told to stop.

It runs the same start-up as the driver (worker/model_setup.load_everything: load, profile,
agree on the KV block count, warm up; then CUDA-graph capture), so the collectives inside line
up rank for rank, and then the same forward code (worker/model_forward.py) for each step.

Started as `python -m ferrox.executor.worker_main CONFIG_JSON RANK SIZE INIT_METHOD` by the mp
executor (a fresh interpreter: no re-import of the user's __main__, no fork of a CUDA process),
or by calling `run_worker` inside a Ray actor.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

import torch

from ferrox.config import EngineConfig
from ferrox.distributed.parallel_state import destroy_tp_group, init_tp_group, use_tp_group
from ferrox.distributed.step_channel import MTP_PASS, MTP_ROUNDS, RELOAD, SHUTDOWN, SLEEP, WAKE, StepChannel
from ferrox.gc_tuning import freeze_startup_heap
from ferrox.lora.rank_plan import plan_from_arrays
from ferrox.speculative_config import verify_len
from ferrox.worker.cuda_graphs import decode_capture_sizes
from ferrox.worker.model_forward import ModelForward, StepArrays
from ferrox.worker.model_setup import load_everything
from ferrox.worker.mtp_proposer import mtp_proposer
from ferrox.worker.rank_images import RankImages
from ferrox.worker.recurrent_states import keep_accepted
from ferrox.worker.sleep_control import reload_into, tags_of
from ferrox.worker.sleep_memory import SleepMemory
from ferrox.worker.step_inputs import Uploader

logger = logging.getLogger("ferrox.executor.worker")


def run_worker(config: EngineConfig, rank: int, size: int, init_method: str, device_index: int | None = None) -> None:
    tp = init_tp_group(rank, size, init_method, config.resolved_device(), config.enable_expert_parallel)
    try:
        loaded = load_everything(config, tp, device_index)
        forward = ModelForward(loaded.model, loaded.kv_caches, loaded.device, tp, Uploader(loaded.device))
        # Multi-LoRA: this rank's share of every adapter, in the slots the driver picks (lora/manager.py);
        # wrapped before the graphs are captured, as on the driver.
        loras = None
        if config.enable_lora:
            from ferrox.lora.manager import LoRAManager, token_capacity

            loras = LoRAManager(loaded.model, max_loras=config.max_loras, max_lora_rank=config.max_lora_rank,
                                max_cpu_loras=config.max_cpu_loras, device=loaded.device, dtype=loaded.dtype,
                                max_num_tokens=token_capacity(loaded.max_num_batched_tokens, loaded.max_num_seqs,
                                                              verify_len(config.speculative_config)))
        if config.kv_offloading_size or config.kv_transfer_config:  # this rank's host tier (worker/host_kv_tier.py)
            from ferrox.worker.host_kv_tier import HostKvTier, configured_slots

            forward.host_tier = HostKvTier(loaded.kv_caches, configured_slots(config, loaded.kv_caches))
        plan = config.graph_plan()
        if loaded.device.type == "cuda" and plan.any:
            forward.capture_cuda_graphs(max_num_seqs=loaded.max_num_seqs, max_model_len=loaded.max_model_len,
                                        block_size=config.block_size, verify_len=verify_len(config.speculative_config),
                                        max_num_batched_tokens=loaded.max_num_batched_tokens, plan=plan)
        with use_tp_group(tp):  # (the MTP layer sharded as the model's)
            mtp = mtp_proposer(config, loaded, tp.size)
        if mtp is not None and loaded.device.type == "cuda" and plan.decode:  # (as the driver: after the target's)
            mtp.capture_cuda_graphs(decode_capture_sizes(plan, loaded.max_num_seqs))
        logger.info("tensor-parallel rank %d/%d ready on %s", rank, size, loaded.device)
        freeze_startup_heap()
        _step_loop(forward, StepChannel(tp), loaded.sleep_memory, loaded.reload_model, loras, mtp)
    finally:
        destroy_tp_group(tp)  # gloo only (see there); the caller exits right after on GPUs


def _step_loop(forward: ModelForward, channel: StepChannel, sleep_memory: SleepMemory | None = None,
               reload_model: Callable[[], Any] | None = None, loras: Any = None, mtp: Any = None) -> None:
    """mtp: this rank's MtpProposer (speculative_config method 'mtp'): it runs the driver's MTP passes over the
    last step's hidden states and their draft rounds."""
    # The Uploader alternates two pinned buffer sets; nothing here reads results back, so before
    # staging step N this rank waits for step N-2's device work (its copies out of those buffers).
    done: collections.deque[Any] = collections.deque()
    cuda = forward.device.type == "cuda"
    # A vision model: this rank mirrors the driver's images and embeds them itself (worker/rank_images.py).
    images = RankImages.for_model(forward.model, forward.device)
    hidden = None  # the last step's hidden states (an MTP pass reads them)
    while True:
        command, arrays = channel.recv()
        if command == SHUTDOWN:
            return
        if command == MTP_PASS:
            assert mtp is not None and hidden is not None
            mtp.run_pass(arrays, hidden)
            continue
        if command == MTP_ROUNDS:
            assert mtp is not None
            mtp.run_rounds(arrays)
            continue
        if command in (SLEEP, WAKE, RELOAD):
            # Sleep mode (worker/sleep_control.py): the driver's sleep, wake_up or reload_weights, here.
            assert sleep_memory is not None and reload_model is not None, "only with enable_sleep_mode"
            done.clear()
            if command == WAKE:
                sleep_memory.wake(tags_of(arrays)[0])
                continue
            if command == SLEEP:
                sleep_memory.sleep(*tags_of(arrays))
            else:
                reload_into(sleep_memory, reload_model)
            torch.distributed.barrier(group=channel.tp.cpu_group)  # the driver returns once every rank is done
            continue
        if cuda and len(done) >= 2:
            done.popleft().synchronize()
        forward.upload.next_step()
        step = StepArrays(arrays)
        if loras is not None:
            loras.follow(plan_from_arrays(arrays))
        if images is None:
            result = forward.run(step, step.prompt_rows)
        else:
            image_rows, rope_positions = images.step_inputs(arrays, step)
            result = forward.run(step, step.prompt_rows, image_rows=image_rows, rope_positions=rope_positions)
        hidden = result.hidden if mtp is not None else None
        if result.meta.draft_state_rows is not None and result.meta.state_rows is not None:
            # A hybrid model's verify step: the driver broadcasts how many drafts each request kept once it has
            # sampled (worker/model_runner.py sample); every rank keeps that draft's state.
            accepted = torch.empty(result.meta.num_reqs, dtype=torch.int64, device=forward.device)
            forward.tp.broadcast(accepted)
            keep_accepted(forward.recurrent_layers, result.meta.state_rows.long(), result.meta.draft_state_rows,
                          accepted)
        if cuda:
            event = torch.cuda.Event()
            event.record()
            done.append(event)


def _die_with_parent() -> None:
    """Linux: get SIGKILL when the driver's process dies, however it dies (no orphaned ranks)."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() == 1:  # the parent died before prctl took effect
        os._exit(1)


def main(argv: list[str]) -> int:
    config_json, rank, size, init_method = argv[0], int(argv[1]), int(argv[2]), argv[3]
    _die_with_parent()
    logging.basicConfig(level=os.environ.get("FERROX_WORKER_LOG_LEVEL", "WARNING"),
                        format=f"%(asctime)s %(levelname)s [tp rank {rank}] %(name)s: %(message)s")
    run_worker(EngineConfig(**json.loads(config_json)), rank, size, init_method)
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown: nothing is left to save, and CUDA/NCCL teardown may stall


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
