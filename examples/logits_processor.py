"""Custom logits processors (vLLM's V1 interface) with the embedded model: `python examples/logits_processor.py`.

Two processors, each switched on per request through `extra_args` (`vllm_xargs` over HTTP, where the server
takes `--logits-processors examples.logits_processor:BanTokens`, the module importable):
- BanTokens, batch-level: a request with {"ban": [token ids]} never samples those tokens;
- EndAfter, per request (an AdapterLogitsProcessor): {"end_after": N} forces end-of-sequence after N tokens.
"""

import torch
from ferrox import LLM, SamplingParams
from ferrox.logits_processor import AdapterLogitsProcessor, BatchUpdate, LogitsProcessor, MoveDirectionality


class BanTokens(LogitsProcessor):
    @classmethod
    def validate_params(cls, params):
        ban = (params.extra_args or {}).get("ban")
        if ban is not None and not (isinstance(ban, list) and all(isinstance(t, int) and t >= 0 for t in ban)):
            raise ValueError(f"ban must be a list of token ids, got {ban!r}")

    def __init__(self, config, device, is_pin_memory):
        self.device = device
        self.banned: dict[int, torch.Tensor] = {}  # row -> the token ids its request bans

    def is_argmax_invariant(self):
        return False  # it changes which token wins

    def update_state(self, update: BatchUpdate | None):
        if update is None:  # the same requests in the same rows as the last step
            return
        for row in update.removed:
            self.banned.pop(row, None)
        for row, params, _prompt_ids, _output_ids in update.added:
            self.banned.pop(row, None)
            ban = (params.extra_args or {}).get("ban")
            if ban:
                self.banned[row] = torch.tensor(ban, device=self.device)
        for a, b, how in update.moved:
            at_a, at_b = self.banned.pop(a, None), self.banned.pop(b, None)
            if at_a is not None:
                self.banned[b] = at_a
            if how is MoveDirectionality.SWAP and at_b is not None:
                self.banned[a] = at_b

    def apply(self, logits):
        for row, ids in self.banned.items():
            logits[row, ids] = float("-inf")
        return logits


class EndAfter(AdapterLogitsProcessor):
    def is_argmax_invariant(self):
        return False

    def new_req_logits_processor(self, params):
        args = params.extra_args or {}
        if "end_after" not in args:
            return None
        limit, eos = args["end_after"], args["eos"]

        def end_after(output_ids, row):  # (the request's live output tokens, its logits row)
            if len(output_ids) >= limit:
                row[:] = float("-inf")
                row[eos] = 0.0
            return row

        return end_after


def main():
    llm = LLM(logits_processors=[BanTokens, EndAfter])
    tokenizer = llm.get_tokenizer()
    digits = [i for i in range(tokenizer.vocab_size) if any(c.isdigit() for c in tokenizer.decode([i]))]
    eos = tokenizer.eos_token_ids[0]
    prompt = "List the first ten prime numbers:"
    for extra in (None, {"ban": digits}, {"end_after": 5, "eos": eos}):
        params = SamplingParams(temperature=0, max_tokens=24, extra_args=extra)
        out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        label = "digits banned" if extra and "ban" in extra else extra
        print(f"{label}: {out.text!r} ({out.finish_reason}, {len(out.token_ids)} tokens)")


if __name__ == "__main__":
    main()
