"""The chat format: ChatML turns made of the special tokens the tokenizer stage reserved.

    <|endoftext|><|im_start|>user\nHow now?<|im_end|>\n<|im_start|>assistant\nWell.<|im_end|>\n

One renderer serves SFT, DPO, evaluation and `kiln chat`, so a model is asked exactly as it was taught.
Each turn's header, content and end marker are encoded separately and concatenated: token boundaries then
fall exactly on turn boundaries, the mask is exact, and a prompt's ids are a prefix of the ids of the prompt
plus its answer (DPO scores answers after a shared prompt). User text is encoded as ordinary text, so a
message containing "<|im_end|>" cannot forge a turn marker.

The conversation opens with `<|endoftext|>` because every pretraining document follows one.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers import Tokenizer

from kiln.pipeline.errors import UserError
from kiln.pipeline.text.bpe import EOT, encode_ids

ROLES = ("system", "user", "assistant")
IM_START, IM_END, PAD = "<|im_start|>", "<|im_end|>", "<|pad|>"


@dataclass
class Rendered:
    ids: list[int]
    mask: list[int]  # 1 on the tokens the model learns to produce: assistant content and its <|im_end|>


class ChatFormat:
    def __init__(self, tokenizer: Tokenizer):
        """`tokenizer` loaded with `ordinary=True` (kiln.pipeline.text.tokenizer.load_tokenizer)."""
        ids = {name: tokenizer.token_to_id(name) for name in (EOT, IM_START, IM_END, PAD)}
        if None in ids.values():
            missing = ", ".join(name for name, i in ids.items() if i is None)
            raise UserError(f"tokenizer: lacks the chat tokens {missing} (retrain it with `kiln tokenizer train`)")
        self.tokenizer = tokenizer
        self.eot, self.im_start, self.im_end, self.pad = (ids[n] for n in (EOT, IM_START, IM_END, PAD))
        self.newline = self.encode("\n")
        self.headers = {role: [self.im_start, *self.encode(f"{role}\n")] for role in ROLES}

    def encode(self, text: str) -> list[int]:
        return encode_ids(self.tokenizer, text)

    def render(self, messages: list[dict], first_trained: int = 0, generation_prompt: bool = False) -> Rendered:
        """Ids and mask of `messages`; assistant turns before index `first_trained` are context, not targets
        (DPO scores only the answer after its prompt). `generation_prompt` appends the assistant header."""
        ids, mask = [self.eot], [0]
        for i, message in enumerate(messages):
            role = message["role"]
            if role not in ROLES:
                raise ValueError(f"messages[{i}].role: {role!r} is not one of {', '.join(ROLES)}")
            header, body = self.headers[role], [*self.encode(message["content"]), self.im_end]
            trained = int(role == "assistant" and i >= first_trained)
            ids += header + body + self.newline
            mask += [0] * len(header) + [trained] * len(body) + [0] * len(self.newline)
        if generation_prompt:
            ids += self.headers["assistant"]
            mask += [0] * len(self.headers["assistant"])
        return Rendered(ids, mask)

    def prompt(self, messages: list[dict]) -> list[int]:
        """What the model sees before it writes the next assistant turn."""
        return self.render(messages, generation_prompt=True).ids

    def reply(self, content: str) -> list[int]:
        """The tokens of an assistant answer as the model produces them: content, then <|im_end|>."""
        return [*self.encode(content), self.im_end]

    def parse_reply(self, ids: list[int]) -> str:
        """The text of a generated answer: everything before the first <|im_end|> (or <|endoftext|>)."""
        stops = (self.im_end, self.eot)
        end = next((i for i, t in enumerate(ids) if t in stops), len(ids))
        return self.tokenizer.decode(ids[:end], skip_special_tokens=False)

    def text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)
