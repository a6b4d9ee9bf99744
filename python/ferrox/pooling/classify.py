"""A sequence-classification model's labels and the activation that turns its logits into scores, read from
config.json as transformers, sentence-transformers and vLLM read them.

Torch-free (numpy only): the classifier models take their label count from here, the pooling config carries
the labels and activation names across the engine-core handshake, and the runner applies the activation to
each request's logits on the host.

    /classify, LLM.classify   problem_type "regression": the logits as they are; "multi_label_classification":
                              sigmoid; else sigmoid for one label, softmax over several (vLLM's classify)
    /score, /rerank, score()  config.json sentence_transformers.activation_fn (sentence-transformers v4+), else
                              sbert_ce_default_activation_function (older CrossEncoder exports; the MS MARCO
                              MiniLM rerankers name Identity there, so their scores are raw logits, as in vLLM),
                              else sigmoid for one label (CrossEncoder's default), softmax over several
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from ferrox.model_spec import ModelLoadError, UnsupportedModelError

ACTIVATIONS = ("sigmoid", "softmax", "tanh", "identity")
# The torch.nn modules a folder may name (vLLM resolves any class under torch.nn.modules; these are the ones
# CrossEncoder exports use). Any other name is refused rather than replaced by a default.
_TORCH_MODULES = {
    "torch.nn.modules.activation.Sigmoid": "sigmoid",
    "torch.nn.modules.activation.Tanh": "tanh",
    "torch.nn.modules.linear.Identity": "identity",
}


def classifier_labels(hf_config: dict[str, Any], where: str = "config.json") -> list[str]:
    """The class names in logit order: id2label (transformers saves it with every classifier), else
    num_labels classes named LABEL_i (transformers' default names; 2 classes when neither is given)."""
    id2label = hf_config.get("id2label")
    if id2label:
        if not isinstance(id2label, dict):
            raise ModelLoadError(f"{where}: field 'id2label' must be an object of index -> label")
        try:
            by_index = {int(k): str(v) for k, v in id2label.items()}
        except (TypeError, ValueError):
            raise ModelLoadError(f"{where}: field 'id2label' keys must be class indices (\"0\", \"1\", ...)") from None
        if sorted(by_index) != list(range(len(by_index))):
            raise ModelLoadError(f"{where}: field 'id2label' must number its classes 0..{len(by_index) - 1}")
        return [by_index[i] for i in range(len(by_index))]
    n = hf_config.get("num_labels", 2)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ModelLoadError(f"{where}: field 'num_labels' must be a positive integer, got {n!r}")
    return [f"LABEL_{i}" for i in range(n)]


def _default(num_labels: int) -> str:
    return "sigmoid" if num_labels == 1 else "softmax"


def classify_activation(hf_config: dict[str, Any], num_labels: int) -> str:
    """What /classify applies (transformers' problem_type decides, as its loss does)."""
    problem = hf_config.get("problem_type")
    if problem == "regression":
        return "identity"
    if problem == "multi_label_classification":
        return "sigmoid"
    return _default(num_labels)


def score_activation(hf_config: dict[str, Any], num_labels: int, where: str = "config.json") -> str:
    """What a cross-encoder's pair score applies (module docstring); an activation ferrox does not know is
    refused by name."""
    st = hf_config.get("sentence_transformers")
    name = st.get("activation_fn") if isinstance(st, dict) else None
    field = "sentence_transformers.activation_fn"
    if name is None:
        name, field = hf_config.get("sbert_ce_default_activation_function"), "sbert_ce_default_activation_function"
    if name is None:
        return _default(num_labels)
    if name not in _TORCH_MODULES:
        raise UnsupportedModelError(f"{where}: {field} {name!r} is not supported (supported: "
                                    f"{', '.join(_TORCH_MODULES)})")
    return _TORCH_MODULES[name]


def apply_activation(logits: npt.NDArray[np.float32], name: str) -> npt.NDArray[np.float32]:
    """One request's scores from its logits [num_labels] (computed in float64: a softmax of large logits)."""
    x = logits.astype(np.float64)
    if name == "sigmoid":
        out = 1.0 / (1.0 + np.exp(-x))
    elif name == "softmax":
        e = np.exp(x - x.max())
        out = e / e.sum()
    elif name == "tanh":
        out = np.tanh(x)
    elif name == "identity":
        out = x
    else:
        raise ValueError(f"activation: {name!r} is not one of {', '.join(ACTIVATIONS)}")
    return np.ascontiguousarray(out, dtype=np.float32)
