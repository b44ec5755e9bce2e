"""Speculative decoding: the configuration, the proposer seam, the n-gram proposer, acceptance.

    LLM(model, speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                   "prompt_lookup_min": 2, "prompt_lookup_max": 4})
    cuteinfer serve MODEL --speculative-config '{"method": "ngram", ...}'

A speculating request's step (engine/scheduler.py): the proposer drafts up to k tokens from the
request's own tokens; the step computes the pending token and the drafts, ``[pending, d1..dk]`` at
positions ``L..L+k``, in one forward (causal attention over the request's paged KV), and samples
every one of those k+1 rows with the request's own sampling parameters at ``step = len(output) +
i`` for row i. With cuteinfer's counter-based sampler the
token sampled at row i is exactly the token plain decoding would sample at that position (given
the same prefix), so accepting the longest prefix of drafts that equals the sampled tokens, plus
the first sampled token after it, is lossless token for token (greedy and seeded sampling alike;
docs: ../shared/DFLASH.md 3.2-3.3). The KV of the pending token and the accepted drafts is kept
(``BlockManager.commit``); the rest is given back (``rollback``).

Requests that want logprobs or prompt logprobs, or have logits processors (whose device state
advances once per sampled row), decode plainly; so does everyone while ``disable_by_batch_size``
or more requests run (each draft costs a row of compute in a batch that may already fill the
GPU), and a request whose drafts keep being rejected stops drafting (``MIN_ACCEPTANCE``).

Exactness: on the numpy backend outputs equal plain decoding's token for token (tests). On cuda a
step whose every token is sampled (spans beside plain decode rows) runs as decode rows, one per
token (``CudaExecutor.verify_rows``), with the GEMM kernels and split-KV factor plain decoding
of the step's B sequences uses, replayed from a verify graph per bucket of B (B x (k+1) rows):
every row's logits are the bits plain decoding computes at that position (tests/gpu/
test_speculative.py), so outputs are equal token for token whenever the plain run decodes the
same requests at the same bucket -- always at batch 1, the default. Plain decoding itself is not
batch-invariant across buckets (each bucket's GEMM tile and split-KV factor), so with
speculation in batches (a larger ``disable_by_batch_size``) a request that reaches a position at
a different batch size than in the plain run can pick the other of two nearly tied tokens.

Proposer methods: ``ngram`` (prompt lookup, on the host) and ``dflash`` (a DFlash drafter:
engine/model/dflash.py on numpy, engine/executor/cuda_dflash.py on cuda)::

    LLM(model, speculative_config={"method": "dflash", "model": DRAFTER_DIR})
    cuteinfer serve MODEL --dflash-draft-model-path DRAFTER_DIR

``num_speculative_tokens`` defaults to the drafter's ``block_size - 1`` (15 for the b16
checkpoints) and may not exceed it. numpy: the executor captures the target's hidden states of
the drafter's ``target_layer_ids`` at every computed token's KV slot (``NumpyExecutor.
enable_capture``); ``DFlashProposer`` reads a request's committed positions' features through
its page table, runs the drafter's block ``[pending, MASK...]`` and proposes its argmax drafts.
cuda: every forward writes the drafter's context K/V of its tokens into the drafter's own
layers of the paged pool, and ``CudaDFlashProposer`` queues each speculating request's block:
the step drafts all of them in one launch inside its verify graph and places the drafts over
the spans' placeholder ids on the device (``DeviceDrafts``): draft, placement and verify are
one graph launch, with no host sync between draft and verify. A request whose block would pass
``max_model_len`` decodes plainly. Drafts never change the output (verification alone decides),
only how many tokens a step commits.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from engine.config import ConfigError, ModelConfig

if TYPE_CHECKING:
    from engine.model.dflash import DFlashDrafter
    from engine.request import Request

METHODS = ("ngram", "dflash")
PLANNED: tuple[str, ...] = ()  # vLLM / SGLang names refused until built
MAX_SPECULATIVE_TOKENS = 16
# after this many speculative steps, a request whose accepted / drafted share is below
# MIN_ACCEPTANCE drafts no more (each rejected draft costs a row of compute)
PROBATION_STEPS = 8
MIN_ACCEPTANCE = 0.1


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    # speculate only while fewer requests than this run: on the H200 a verify span runs eagerly
    # while plain decode replays a graph, so n-gram speculation paid at batch 1 (qwen3-8b,
    # +14%) and lost at batch 8 (-20%; docs/perf.md v15)
    disable_by_batch_size: int = 2
    model: str | None = None  # dflash: the drafter checkpoint directory

    @classmethod
    def parse(cls, value: str | dict | None) -> SpeculativeConfig | None:
        """``--speculative-config`` (JSON text) or the LLM keyword (a dict); None: off.
        ConfigError naming the field and what to do."""
        if value is None or value == "":
            return None
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise ConfigError(f"speculative_config must be a JSON object: {e}") from None
        if not isinstance(value, dict):
            raise ConfigError("speculative_config must be a JSON object such as "
                              '{"method": "ngram", "num_speculative_tokens": 4}')
        known = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
                 "disable_by_batch_size", "model"}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ConfigError(f"speculative_config: unsupported field(s) {unknown}; supported: "
                              f"{sorted(known)}")
        method = value.get("method", "ngram")
        if method in PLANNED:
            raise ConfigError(f"speculative_config.method {method!r} is not built yet; use "
                              f"one of {list(METHODS)}")
        if method not in METHODS:
            raise ConfigError(f"speculative_config.method must be one of {list(METHODS)}, got "
                              f"{method!r}")
        if method == "dflash":
            return cls._parse_dflash(value)
        if "model" in value:
            raise ConfigError("speculative_config.model: the ngram method takes no draft model")
        ints = {k: value.get(k, getattr(cls, k)) for k in
                ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
                 "disable_by_batch_size")}
        for k, v in ints.items():
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"speculative_config.{k} must be an integer >= 1, got {v!r}")
        if ints["num_speculative_tokens"] > MAX_SPECULATIVE_TOKENS:
            raise ConfigError(f"speculative_config.num_speculative_tokens must be <= "
                              f"{MAX_SPECULATIVE_TOKENS}, got {ints['num_speculative_tokens']}")
        if ints["prompt_lookup_min"] > ints["prompt_lookup_max"]:
            raise ConfigError("speculative_config.prompt_lookup_min must be <= "
                              f"prompt_lookup_max, got {ints['prompt_lookup_min']} > "
                              f"{ints['prompt_lookup_max']}")
        return cls(method=method, **ints)

    @classmethod
    def _parse_dflash(cls, value: dict) -> SpeculativeConfig:
        for k in ("prompt_lookup_min", "prompt_lookup_max"):
            if k in value:
                raise ConfigError(f"speculative_config.{k}: only the ngram method takes it; "
                                  "leave it out for dflash")
        model = value.get("model")
        if not isinstance(model, str) or not model:
            raise ConfigError('speculative_config.model is required for method "dflash": the '
                              "DFlash drafter checkpoint directory (or pass "
                              f"--dflash-draft-model-path DIR), got {model!r}")
        from engine.model.dflash import DFlashConfig

        dc = DFlashConfig.from_pretrained(model)
        most = min(dc.num_drafts, MAX_SPECULATIVE_TOKENS)
        ints = {"num_speculative_tokens": value.get("num_speculative_tokens", most),
                "disable_by_batch_size": value.get("disable_by_batch_size",
                                                   cls.disable_by_batch_size)}
        for k, v in ints.items():
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"speculative_config.{k} must be an integer >= 1, got {v!r}")
        if ints["num_speculative_tokens"] > most:
            raise ConfigError(
                f"speculative_config.num_speculative_tokens must be <= {most} (the drafter's "
                f"block_size {dc.block_size} - 1"
                + (f", at most {MAX_SPECULATIVE_TOKENS}" if most < dc.num_drafts else "")
                + f"), got {ints['num_speculative_tokens']}")
        return cls(method="dflash", model=model, **ints)

    def check(self, target: ModelConfig, backend: str, tensor_parallel_size: int) -> None:
        """What only the engine's model and backend can tell: a dflash drafter must fit the
        target model (on cuda also its kernels: ``DFlashConfig.check_cuda``) and run with one
        rank."""
        if self.method != "dflash":
            return
        if tensor_parallel_size != 1:
            raise ConfigError(
                "speculative_config.method 'dflash' runs with tensor_parallel_size 1 so far; "
                "use method 'ngram' with tensor parallelism")
        from engine.model.dflash import DFlashConfig

        assert self.model is not None
        field = f"speculative_config.model {self.model!r}"
        dc = DFlashConfig.from_pretrained(self.model)
        dc.check_target(target, field)
        if backend == "cuda":
            dc.check_cuda(target, field)

    def to_json(self) -> str:
        return json.dumps(self.__dict__)


def ngram_propose(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Prompt lookup, vLLM's rule: for n from ``max_n`` down to ``min_n``, the first earlier
    occurrence of the last n tokens in ``tokens``; the up to ``k`` tokens that followed it.
    [] when none matches."""
    size = len(tokens)
    if k < 1 or size < min_n + 1:
        return []
    a = np.asarray(tokens, dtype=np.int64)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        # windows a[i:i+n] for i in [0, size - n): every earlier start (the suffix itself
        # starts at size - n); a window may overlap the suffix, one token at least follows it
        m = size - n
        hit = np.ones(m, dtype=bool)
        tail = a[m:]
        for j in range(n):
            hit &= a[j:j + m] == tail[j]
        idx = np.flatnonzero(hit)
        if idx.size:
            start = int(idx[0]) + n
            return a[start:start + k].tolist()
    return []


class DeviceDrafts:
    """``k`` drafts a proposer leaves to the device, those of block ``slot`` of the step's
    draft launch (the cuda DFlash drafter: engine/executor/cuda_dflash.py), instead of a list:
    the scheduler gives the span ``k`` placeholder tokens, the executor drafts and places the
    drafts over the span's input rows on the device right before the verify forward (no host
    sync between draft and verify) and returns them with the step's samples
    (``StepOutput.drafts``), from which acceptance is computed. ``tolist()`` reads them now (it
    drafts and waits: tests and spies)."""

    __slots__ = ("k", "slot", "_read")

    def __init__(self, k: int, slot: int, read: Any) -> None:
        self.k, self.slot, self._read = int(k), int(slot), read

    def __len__(self) -> int:
        return self.k

    def tolist(self) -> list[int]:
        return list(self._read())[:self.k]

    def __iter__(self) -> Any:
        return iter(self.tolist())

    def __repr__(self) -> str:
        return f"DeviceDrafts(k={self.k}, slot={self.slot})"


def accept(drafts: tuple[int, ...] | list[int], sampled: list[int]) -> int:
    """How many drafts are accepted: the longest prefix with ``drafts[i] == sampled[i]``
    (``sampled[i]`` is the token the target drew at row i, the row before draft i+1)."""
    m = 0
    for d, y in zip(drafts, sampled, strict=False):
        if d != y:
            break
        m += 1
    return m


def eligible(params: Any, procs: Any) -> bool:
    """A request that may speculate: no logprobs, no prompt logprobs, no logits processors."""
    return params.logprobs is None and params.prompt_logprobs is None and procs is None


class DFlashProposer:
    """The DFlash drafter behind the scheduler's proposer seam: ``(request, k) -> drafts``.

    For a decoding request with committed length L (positions 0..L-1 computed; its pending
    token, the last one, sits at position L) it gathers the target features of positions
    0..L-1 from the executor's per-slot capture store through the request's page table, runs
    the drafter's block and returns the first k of its ``block_size - 1`` drafts. The numpy
    drafter recomputes the context projection and every draft layer's context K/V on each call
    (O(L) work per draft step, see engine/model/dflash.py): simple and exact, fine for the
    reference backend. No drafts (plain decode) when the block would pass ``max_model_len``."""

    def __init__(self, drafter: DFlashDrafter, features: np.ndarray, block_manager: Any,
                 page_size: int, max_model_len: int) -> None:
        self.drafter, self.features, self.bm = drafter, features, block_manager
        self.page_size, self.max_model_len = page_size, max_model_len

    def context_features(self, req: Request) -> np.ndarray:
        """[L, n*H]: the captured features of the request's committed positions."""
        n, ps = req.num_computed_tokens, self.page_size
        table = np.frombuffer(self.bm.page_table_view(req.request_id), np.int32)
        pos = np.arange(n)
        return self.features[table[pos // ps].astype(np.int64) * ps + pos % ps]

    def __call__(self, req: Request, k: int) -> list[int]:
        n = req.num_computed_tokens
        if n + self.drafter.block_size > self.max_model_len or k < 1:
            return []
        pending = req.token_slice(n, 1)[0]
        return self.drafter.propose(self.context_features(req), pending)[:k].tolist()


def build_dflash_proposer(spec: SpeculativeConfig, target: ModelConfig, executor: Any,
                          block_manager: Any, max_model_len: int) -> Any:
    """The proposer of ``spec.model`` (checked against ``target``). cuda: the executor built
    the drafter with its memory plan (engine/executor/cuda_dflash.py). numpy: load it, turn on
    the executor's hidden-state capture of the drafter's target layers; the drafter borrows the
    target's embedding and lm_head from the executor's reference model."""
    from engine.model.dflash import DFlashDrafter, load_drafter

    cuda = getattr(executor, "dflash_proposer", None)
    if cuda is not None:
        return cuda(block_manager, max_model_len)
    enable, model = getattr(executor, "enable_capture", None), getattr(executor, "model", None)
    if enable is None or model is None:
        raise ConfigError("speculative_config.method 'dflash' needs the numpy or the cuda "
                          "backend (one rank)")
    assert spec.model is not None
    ckpt = load_drafter(spec.model, target)
    store = enable(ckpt.config.target_layer_ids)
    drafter = DFlashDrafter(ckpt, model.embed, model.lm_head, target.rope_scaling)
    return DFlashProposer(drafter, store, block_manager, executor.page_size, max_model_len)
