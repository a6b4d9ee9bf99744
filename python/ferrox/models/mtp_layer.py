"""What the MTP drafter modules share (models/qwen3_5_mtp.py, models/deepseek_mtp.py): the target they draft for,
held outside their own parameters, the checkpoint prefix of their tensors (the target's `mtp_checkpoint_prefix`),
and the finalize after loading (quantized layers' runners, then the target's own after-load step for its layer
kind, `finalize_mtp`, where it has one: DeepSeek's latent-attention absorption)."""

from __future__ import annotations

from typing import Any

from torch import nn


class MtpLayer(nn.Module):
    def __init__(self, target: Any):
        super().__init__()
        self.spec = target.spec
        self.checkpoint_prefix: str = target.mtp_checkpoint_prefix  # (the tensors worker/mtp_proposer.py reads)
        self._target = [target]  # (a list: the target's parameters are not this module's)

    @property
    def target(self) -> Any:
        return self._target[0]

    def finalize_weights(self) -> None:
        for module in self.modules():
            finalize = getattr(module, "finalize_quantized", None)
            if finalize is not None:
                finalize()
        after_load = getattr(self.target, "finalize_mtp", None)
        if after_load is not None:
            after_load(self)
