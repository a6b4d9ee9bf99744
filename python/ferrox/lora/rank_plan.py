"""A step's LoRA slot plan (lora/manager.py SlotPlan) as numpy arrays in the step message the driver
broadcasts to the other tensor-parallel ranks (distributed/step_channel.py carries only arrays):
`lora_slots` (int32 [T], each token's slot, -1: none) and, when adapters were copied into slots,
`lora_loads` (the UTF-8 JSON of [[slot, id, name, path], ...]: each rank reads its share of a new
adapter from the same folder, so the folder must be readable on every rank's host, as in vLLM)."""

from __future__ import annotations

import json

import numpy as np

from ferrox.lora.manager import SlotPlan
from ferrox.lora.request import LoRARequest


def plan_arrays(plan: SlotPlan) -> dict[str, np.ndarray]:
    arrays = {"lora_slots": np.ascontiguousarray(plan.slot_of_token, dtype=np.int32)}
    if plan.loads:
        loads = [[slot, r.lora_int_id, r.lora_name, r.lora_path] for slot, r in plan.loads]
        arrays["lora_loads"] = np.frombuffer(json.dumps(loads).encode(), dtype=np.uint8)
    return arrays


def plan_from_arrays(arrays: dict[str, np.ndarray]) -> SlotPlan | None:
    """The plan in a step message, None for a step of an engine without LoRA."""
    slots = arrays.get("lora_slots")
    if slots is None:
        return None
    raw = arrays.get("lora_loads")
    loads = [] if raw is None else [(int(slot), LoRARequest(name, int(lora_id), path))
                                    for slot, lora_id, name, path in json.loads(raw.tobytes().decode())]
    return SlotPlan(loads, np.asarray(slots, dtype=np.int32))
