"""Offline API: ``LLM(config).generate(prompts, params)``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from slimkv.config import Config
from slimkv.engine.outputs import RequestOutput
from slimkv.plugins import build_engine
from slimkv.engine.sampling import SamplingParams

Prompt = str | list[int]
Messages = list[dict[str, str]]


@dataclass(slots=True)
class GenerationResult:
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str
    num_cached_tokens: int


class LLM:
    def __init__(self, config: Config | str | Path | None = None) -> None:
        if not isinstance(config, Config):
            config = Config.load(config)
        self.engine = build_engine(config)
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: Prompt | list[Prompt],
                 params: SamplingParams | list[SamplingParams] | None = None,
                 progress: bool = False) -> list[GenerationResult]:
        """Generate for every prompt in one continuous batch; results in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params or SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        seqs = [self.engine.add_request(p, sp) for p, sp in zip(prompts, params)]
        finals: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(seqs), disable=not progress, desc="generate")
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.finished:
                    finals[out.request_id] = out
                    bar.update()
        bar.close()
        return [GenerationResult(s.token_ids[:s.num_prompt_tokens], finals[s.request_id].text,
                                 finals[s.request_id].token_ids,
                                 finals[s.request_id].finish_reason, s.num_cached_tokens)
                for s in seqs]

    def chat(self, conversations: Messages | list[Messages],
             params: SamplingParams | list[SamplingParams] | None = None) -> list[GenerationResult]:
        """Apply the model's chat template to each conversation and generate."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        prompts = [self.tokenizer.apply_chat_template(c) for c in conversations]
        return self.generate(prompts, params)
