"""A problem as the model reads it: a chat problem's messages in the tokenizer's chat template,
else BOS and the prompt.

    ids = encode_prompt(tokenizer, problem)
"""
from __future__ import annotations

from laminar_hpc.tasks.problem import Problem


def chat_messages(problem: Problem) -> list[dict[str, str]]:
    """A chat problem as the messages a chat template takes: a row's own conversation, else
    [system,] user."""
    if problem.messages is not None:
        return [dict(m) for m in problem.messages]
    system = [{"role": "system", "content": problem.system}] if problem.system is not None else []
    return system + [{"role": "user", "content": problem.prompt}]


def render_chat(tokenizer, messages: list[dict[str, str]]) -> str:
    """`messages` in the tokenizer's own chat template, ending where the assistant's answer starts.

    Tokenizers say how through `chat_prompt(messages)` (model/tokenizer.py; model/hf.py's
    HFTokenizer uses the checkpoint's template)."""
    render = getattr(tokenizer, "chat_prompt", None)
    if render is not None:
        return render(messages)
    raise ValueError(f"the tokenizer ({type(tokenizer).__name__}) has no chat template; set model.tokenizer: hf "
                     "and model.hf_tokenizer (or model.hf_path) to a tokenizer that has one")


def encode_prompt(tokenizer, problem: Problem) -> list[int]:
    """The prompt's token ids: a chat problem rendered with the tokenizer's chat template (the
    template writes any BOS itself), else BOS (when the tokenizer's model uses one) + the prompt."""
    if problem.chat:
        return tokenizer.encode(render_chat(tokenizer, chat_messages(problem)))
    bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    return bos + tokenizer.encode(problem.prompt)
