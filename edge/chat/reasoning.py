"""Reasoning content: models that think first (Qwen3, QwQ, DeepSeek-R1 and its distills) write
`<think>...</think>` before the answer. That text is the answer's `reasoning_content`, not its `content`, and a
structured-output or tool constraint applies after it (the grammar lets the thinking through first).

Detected from the chat template (it mentions `<think>`) or set by the `reasoning_parser` option. Where the
template's generation prompt already opens the thinking (DeepSeek-R1's `<｜Assistant｜><think>\\n`), the answer
starts inside it and only `</think>` comes; elsewhere (Qwen3) the answer may start with `<think>` or skip it.

`split_reasoning` splits a finished answer; `ReasoningStream` splits one as it streams, holding back only what may
be the start of a tag.
"""

from __future__ import annotations

import re

OPEN, CLOSE = "<think>", "</think>"
_PROMPT_OPENS = re.compile(r"<think>(\\n|\n)?\s*['\"]\s*}}\s*({%-?\s*endif\s*-?%}\s*)?$")


def detect_reasoning(template: str) -> str:
    """"think" when the template's model thinks in <think> tags, else ""."""
    return "think" if OPEN in template else ""


def opens_thinking(template: str) -> bool:
    """Whether the generation prompt ends in an opened <think>: the template rendered for one user message (in a
    sandbox, as the prefill worker renders it), or where it does not render, its text's last output."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def refuse(message):
        raise ValueError(message)
    try:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        prompt = env.from_string(template).render(messages=[{"role": "user", "content": "hi"}], bos_token="",
                                                  eos_token="", add_generation_prompt=True, raise_exception=refuse)
    except Exception:
        return bool(_PROMPT_OPENS.search(template.rstrip()))
    return prompt.rstrip().endswith(OPEN)


def split_reasoning(text: str, think_in_prompt: bool) -> tuple[str | None, str]:
    """(the reasoning, the content) of a finished answer; reasoning None when the model did not think. An answer
    cut inside its thinking is all reasoning."""
    stream = ReasoningStream(think_in_prompt)
    reasoning, content = stream.feed(text)
    more_reasoning, more_content = stream.finish()
    reasoning += more_reasoning
    return (reasoning if stream.thought else None), content + more_content


class ReasoningStream:
    """Feed the answer's text as it comes; each feed gives (reasoning, content) that may go out now."""

    def __init__(self, think_in_prompt: bool) -> None:
        self.state = "thinking" if think_in_prompt else "start"  # "start" -> "thinking" -> "after" -> "answer"
        self.thought = think_in_prompt
        self._pending = ""
        self._opening = True  # the thinking's first newlines (after the tag) are dropped

    def feed(self, text: str) -> tuple[str, str]:
        self._pending += text
        reasoning, content = "", ""
        while self._pending:
            if self.state == "start":
                head = self._pending.lstrip()
                if head.startswith(OPEN):
                    self.state, self.thought, self._pending = "thinking", True, head[len(OPEN):]
                elif not head or OPEN.startswith(head):
                    break  # white space, or part of the tag: wait
                else:
                    self.state = "answer"
            elif self.state == "thinking":
                if self._opening:
                    self._pending = self._pending.lstrip("\n")
                    self._opening = not self._pending
                    continue
                at = self._pending.find(CLOSE)
                if at < 0:
                    keep = _partial_suffix(self._pending, CLOSE)
                    reasoning += self._pending[:len(self._pending) - keep]
                    self._pending = self._pending[len(self._pending) - keep:]
                    break
                reasoning += self._pending[:at]
                self.state, self._pending = "after", self._pending[at + len(CLOSE):]
            elif self.state == "after":  # the answer after the thinking starts at its first visible character
                self._pending = self._pending.lstrip()
                if self._pending:
                    self.state = "answer"
            else:
                content, self._pending = content + self._pending, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What was held back, at the answer's end."""
        pending, self._pending = self._pending, ""
        if self.state == "thinking":
            return pending, ""
        return "", "" if self.state == "after" else pending


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of text that is a proper start of tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def reasoning_rules(think_in_prompt: bool) -> str:
    """Lark rules ending in `think_start`: the thinking before a constrained answer, one lexeme that ends at the
    first </think> (lazy), then white space; optional unless the prompt opened it."""
    opening = "" if think_in_prompt else '"<think>" '
    block = "think_block /[ \\t\\r\\n]*/"
    return (f'think_block[lazy]: {opening}/(.|\\n)*/ "</think>"\n'
            f"think_start: {block if think_in_prompt else f'({block})?'}")


MAX_REASONING_TOKENS_REFUSAL = (
    "'max_reasoning_tokens' is not supported: closing a model's thinking at a token budget means forcing "
    "'</think>' into its output mid-decode, which the decode engine does not do (leave it out; 'max_tokens' bounds "
    "the whole answer, thinking included)")
