"""The engine core's side of multi-LoRA: which adapters exist, which live requests use which.

The adapters' weights and GPU slots belong to the `LoRAManager` (ferrox/lora/manager.py); the
scheduler caps the distinct adapters of one step at `max_loras` (the manager's slots). This class
keeps the rest of the bookkeeping the core needs:

- a request names its adapter with (lora_int_id, lora_name, lora_path); the first request with an
  id loads that adapter (so every data-parallel core loads what its own requests use);
- removing an adapter while requests still run with it is deferred until the last one leaves;
  new requests cannot pick it meanwhile unless they bring its path again (which re-adds it);
- the manager's CPU cache holds max_cpu_loras adapters: one evicted while requests still use it is
  read from its folder again before their next step (`prepare_step`), as vLLM's workers do.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

import numpy as np

from ferrox.config import EngineConfig
from ferrox.errors import InvalidArgumentError

if TYPE_CHECKING:
    from ferrox.lora.manager import SlotPlan
    from ferrox.lora.request import LoRARequest


def check_lora_request(lora_request: Any) -> None:
    """The shape of a request's `lora_request` (vLLM's LoRARequest), before it leaves the front-end."""
    from ferrox.lora.request import LoRARequest

    if not isinstance(lora_request, LoRARequest):
        raise InvalidArgumentError(f"lora_request: expected a LoRARequest, got {type(lora_request).__name__}",
                                   param="lora_request")


def lora_fields(lora_request: LoRARequest | None) -> dict[str, Any]:
    """EngineCoreRequest's flattened LoRA fields for a request's adapter (none: the base model)."""
    if lora_request is None:
        return {}
    check_lora_request(lora_request)
    return {"lora_int_id": lora_request.lora_int_id, "lora_name": lora_request.lora_name,
            "lora_path": lora_request.lora_path}


def check_lora_config(config: EngineConfig) -> None:
    """Refuse by name the combinations this version does not run with LoRA (none left: tensor parallelism
    shards the adapters as it shards the layers, speculation checks drafts with the adapted model)."""


class EngineLoRAs:
    def __init__(self, model: Any, config: EngineConfig, *, device: Any, dtype: Any, max_num_tokens: int) -> None:
        from ferrox.lora.manager import LoRAManager

        self.manager = LoRAManager(model, max_loras=config.max_loras, max_lora_rank=config.max_lora_rank,
                                   max_cpu_loras=config.max_cpu_loras, device=device, dtype=dtype,
                                   max_num_tokens=max_num_tokens)
        self._of_request: dict[str, int] = {}
        self._known: dict[int, LoRARequest] = {}  # every adapter added, by id (paths to reload from)
        self._users: Counter[int] = Counter()
        self._pending_removal: set[int] = set()

    # ---- adapters ---------------------------------------------------------------------------------
    def add(self, lora_name: str, lora_int_id: int, lora_path: str) -> None:
        """Load (or keep) an adapter; raises LoRAAdapterError naming the file and field."""
        from ferrox.lora.request import LoRARequest

        request = LoRARequest(lora_name, lora_int_id, lora_path)
        self.manager.add_adapter(request)
        self._known[lora_int_id] = request
        self._pending_removal.discard(lora_int_id)

    def remove(self, lora_int_id: int) -> bool:
        """Forget an adapter; with requests still using it, once they are gone. False: unknown id."""
        if lora_int_id not in self._known or lora_int_id in self._pending_removal:
            return False
        if self._users[lora_int_id]:
            self._pending_removal.add(lora_int_id)
            return True
        self._forget(lora_int_id)
        return True

    def _forget(self, lora_int_id: int) -> None:
        del self._known[lora_int_id]
        self.manager.remove_adapter(lora_int_id)

    def names(self, lora_int_ids: list[int]) -> list[str]:
        """The adapters' names (their ids for one no longer known), for metrics."""
        return [self._known[i].lora_name if i in self._known else str(i) for i in lora_int_ids]

    def list_ids(self) -> list[int]:
        return sorted(i for i in self._known if i not in self._pending_removal)

    def prepare_step(self, token_lora_ids: Any) -> SlotPlan:
        """The model runner's call before each forward: reload adapters the CPU cache evicted, then
        let the manager fill its slots and the per-token slot index; returns its plan for the other
        tensor-parallel ranks."""
        wanted = [i for i in np.unique(token_lora_ids).tolist() if i]  # a few ids, not T tokens
        if wanted:
            resident = {r.lora_int_id for r in self.manager.list_adapters()}
            for lora_int_id in wanted:
                if lora_int_id not in resident:
                    self.manager.add_adapter(self._known[lora_int_id])
        return self.manager.prepare_step(token_lora_ids)

    # ---- requests ---------------------------------------------------------------------------------
    def admit(self, request_id: str, lora_int_id: int, lora_name: str | None, lora_path: str | None) -> None:
        """A request with an adapter arrives: make sure the adapter is loaded, count the user."""
        if lora_int_id not in self._known or lora_int_id in self._pending_removal:
            if not lora_path:
                raise InvalidArgumentError(f"lora_request: adapter id {lora_int_id} is not loaded and the request "
                                           "gives no lora_path", param="lora_request")
            self.add(lora_name or str(lora_int_id), lora_int_id, lora_path)
        self._of_request[request_id] = lora_int_id
        self._users[lora_int_id] += 1

    def release(self, request_ids: list[str]) -> None:
        """Requests left the core: drop their counts, finish deferred removals."""
        for rid in request_ids:
            lora_int_id = self._of_request.pop(rid, None)
            if lora_int_id is None:
                continue
            self._users[lora_int_id] -= 1
            if not self._users[lora_int_id]:
                del self._users[lora_int_id]
                if lora_int_id in self._pending_removal:
                    self._pending_removal.discard(lora_int_id)
                    self._forget(lora_int_id)
