"""The keywords of the Python API's generation calls (generate.py `generate` and `stream_generate`,
batch_decoder.py `batch_generate`) beyond the pair and the prompt: one checked group, which each call takes as
`**options`, refusing a misspelt or unsupported keyword in one line before any work."""

from dataclasses import dataclass, fields
from typing import Optional, Union

from ..errors import DFlashError
from ..models.no_drafter import NoDrafter
from ..policies.dcut import build_policy
from ..policies.width import WidthOptions, WidthPolicy
from .prompt_cache import PromptCache
from .sampling import SamplingParams, sampling_problem

KEYWORDS = ("temp", "top_p", "top_k", "min_p")  # make_sampler's names for the sampling settings

SAMPLER = ("sampler= takes a function that draws a token, but speculative sampling needs the distribution itself: "
           "pass temp=, top_p=, top_k=, min_p= (make_sampler's arguments)")


def check_seed(seed, name: str = "--seed") -> None:
    """MLX seeds its random state with an unsigned 64-bit integer."""
    if seed is not None and not 0 <= seed < 2**64:
        raise DFlashError(f"{name} must be an integer from 0 to 2**64 - 1, got {seed}")


@dataclass(frozen=True)
class GenerationOptions:
    """How to generate: sampling as `mlx_lm.sample_utils.make_sampler` takes it (temp 0 is greedy; every token is
    distributed as mlx-lm draws it with the same settings), the seed of a reproducible sample, the verify width
    ("auto", the default, or a number of rows) and trees, or a width policy built already (policies/dcut.py
    `build_policy`, in place of width and tree), prompt tokens per read chunk, and a prefix cache to start from
    and keep the state in (decoding/prompt_cache.py)."""

    temp: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: Optional[int] = None
    width: Union[int, str, None] = None
    tree: Optional[bool] = None  # trees of the drafter's likeliest paths (True), one path (False), the policy's (None)
    policy: Optional[WidthPolicy] = None
    prefill_step_size: Optional[int] = None  # None: the machine's (machine.py `prefill_step`)
    prompt_cache: Optional[PromptCache] = None

    @classmethod
    def of(cls, keywords: dict) -> "GenerationOptions":
        """The keywords a call was given, checked."""
        if "sampler" in keywords:
            raise DFlashError(SAMPLER)
        names = [f.name for f in fields(cls)]
        if unknown := sorted(set(keywords) - set(names)):
            raise DFlashError(f"no generation keyword {unknown[0]!r}: the keywords are {', '.join(names)}")
        return cls(**keywords)

    def __post_init__(self):
        if problem := sampling_problem(self.temp, self.top_p, self.top_k, self.min_p, KEYWORDS):
            raise DFlashError(problem)
        check_seed(self.seed, "seed")
        if self.prefill_step_size is not None and self.prefill_step_size < 1:
            raise DFlashError(f"prefill_step_size must be at least 1, got {self.prefill_step_size}")
        if self.policy is not None and (self.width is not None or self.tree is not None):
            raise DFlashError("policy= is a width policy built already, which sets the width and trees: pass "
                              "policy= or width=/tree=, not both")

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(self.temp, self.top_p, self.top_k, self.min_p)

    def drafter_and_policy(self, target, drafter, max_batch: int = 1) -> tuple:
        """(the drafter bound to the target, the width policy): drafter None drafts from the context alone
        (models/no_drafter.py); the policy is the one given, else built from width and tree for batches of up
        to max_batch requests."""
        drafter = NoDrafter().bind(target) if drafter is None else drafter
        if not drafter.is_bound:
            drafter.bind(target)
        if self.policy is not None:
            return drafter, self.policy
        seeded = self.seed is not None and not self.sampling.greedy
        widths = WidthOptions(self.width, tree=self.tree).with_default(seeded_sample=seeded)
        return drafter, build_policy(target, drafter, widths, max_batch)
