"""Our model as an lm-eval model type, `diloco`, answering lm-eval's three request kinds with this
harness's batched scoring and generation (docs/evaluation.md#lm-eval-bridge). Needs the `[eval]`
extra (lm-eval, no torch). lm-eval finds models only in its own registry, never through an entry
point, so its command line runs through this module, which registers the model first:

    python -m diloco.evaluation.lm_eval_bridge --model diloco --model_args checkpoint=runs/x \
        --tasks my_task --include_path tasks/
"""

from __future__ import annotations

import itertools
import sys

from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from diloco.evaluation import scoring
from diloco.evaluation.harness import encode_pair, encode_prompt

DEFAULT_BATCH = 8
MAX_GEN_TOKS = 256  # lm-eval's default when a task sets none


def _batch_size(value) -> int:
    """lm-eval passes --batch_size as given (an int, a string of digits, or "auto"); "auto" and
    none mean our default, since batches here are fixed-shape and split over the host's devices."""
    if value in (None, "", "auto") or str(value).startswith("auto"):
        return DEFAULT_BATCH
    if not str(value).isdigit() or int(value) <= 0:
        raise ValueError(f"batch_size={value!r} must be a positive integer or auto")
    return int(value)


@register_model("diloco")
class DilocoLM(LM):
    """`--model_args checkpoint=<run dir | HF folder | .gguf | smollm2>[,dtype=bfloat16]`: whatever
    scripts/evaluate.py takes. Greedy generation only (a task asking to sample is refused)."""

    def __init__(self, checkpoint: str = "", dtype: str = "float32", batch_size=None, pretrained=None,
                 **_ignored) -> None:
        """`pretrained`: a diloco.hf.Pretrained already loaded, in place of `checkpoint` (from Python,
        as lm-eval's hf model takes a model object)."""
        super().__init__()
        from diloco.hf import CheckpointError, load, resolve
        if pretrained is None and not checkpoint:
            raise ValueError("--model_args checkpoint=<run dir | HF folder | .gguf | smollm2> is required")
        self.pre = pretrained if pretrained is not None else load(resolve(checkpoint), dtype=dtype)
        if self.pre.tokenizer is None:
            raise CheckpointError(f"{self.pre.path} has no tokenizer.json, so requests cannot be encoded")
        self.batch = _batch_size(batch_size)

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        pairs = [encode_pair(self.pre.tokenizer, context, continuation)
                 for context, continuation in (r.args for r in requests)]
        return scoring.loglikelihoods(self.pre.model, self.pre.config.max_seq_len, pairs, self.batch)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each text's whole loglikelihood in disjoint windows of the model's length, each token
        predicted once, the first from the BOS (else EOS) token: lm-eval's own windowing."""
        prefix = encode_pair(self.pre.tokenizer, "", "")[0][0]
        windows = [[make_disjoint_window(w) for w in get_rolling_token_windows(
            self.pre.tokenizer.encode(text, add_special_tokens=False), prefix, self.pre.config.max_seq_len, 1)]
            for (text,) in (r.args for r in requests)]
        flat = scoring.loglikelihoods(self.pre.model, self.pre.config.max_seq_len,
                                      list(itertools.chain.from_iterable(windows)), self.batch)
        out, at = [], 0
        for w in windows:
            out.append(sum(ll for ll, _ in flat[at:at + len(w)]))
            at += len(w)
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations, batched per distinct (stop strings, max_gen_toks)."""
        out: list[str | None] = [None] * len(requests)
        groups: dict[tuple, list[int]] = {}
        for i, r in enumerate(requests):
            kwargs = dict(r.args[1] or {})
            if kwargs.get("do_sample") or float(kwargs.get("temperature") or 0.0) > 0:
                raise ValueError(f"generation_kwargs {kwargs}: the diloco model generates greedily only "
                                 "(do_sample: false, temperature: 0)")
            until = kwargs.get("until") or ()
            until = (until,) if isinstance(until, str) else tuple(until)
            groups.setdefault((until, int(kwargs.get("max_gen_toks") or MAX_GEN_TOKS)), []).append(i)
        for (until, max_gen_toks), index in groups.items():
            prompts = [encode_prompt(self.pre.tokenizer, requests[i].args[0]) for i in index]
            texts = scoring.generate_until(self.pre.model, self.pre.config, self.pre.tokenizer, prompts, until,
                                           max_gen_toks, self.batch)
            for i, text in zip(index, texts):
                out[i] = text
        return out


def main() -> None:
    """lm-eval's own command line, with the diloco model registered."""
    from lm_eval.__main__ import cli_evaluate
    sys.argv[0] = "lm_eval"
    cli_evaluate()


if __name__ == "__main__":
    main()
