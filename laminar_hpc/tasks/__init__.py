"""Tasks: deterministic problem sources and their verifiable rewards."""
from __future__ import annotations

from laminar_hpc.tasks.base import Problem, TaskSource


def build_task(cfg, seed: int) -> TaskSource:
    """The task source a config's `task:` section describes (same seed -> same problems)."""
    if cfg.type == "builtin":
        from laminar_hpc.tasks.builtin import BuiltinTasks
        return BuiltinTasks(list(cfg.kinds), seed, cfg.min_len, cfg.max_len, cfg.tail_alpha, cfg.weights)
    if cfg.type == "synthetic":
        from laminar_hpc.tasks.synthetic import SyntheticTasks
        return SyntheticTasks(seed, cfg.prompt_tokens)
    if cfg.type == "arith":
        from laminar_hpc.tasks.arith import ArithTasks
        return ArithTasks(seed, ops=list(cfg.ops), operands=cfg.operands, max_value=cfg.max_value,
                          instruction=cfg.instruction, system_prompt=cfg.system_prompt, chat=cfg.chat_template)
    from laminar_hpc.tasks.jsonl import JsonlTasks
    # chat_template / system_prompt: read with defaults, so a config section without them still builds
    return JsonlTasks(cfg.path, prompt_field=cfg.prompt_field, answer_field=cfg.answer_field,
                      answer_format=cfg.answer_format, reward=cfg.reward,
                      prompt_template=cfg.prompt_template, on_bad_row=cfg.on_bad_row,
                      chat=getattr(cfg, "chat_template", False), system_prompt=getattr(cfg, "system_prompt", None))


def chat_messages(problem: Problem) -> list[dict[str, str]]:
    """A chat problem as the messages a chat template takes: [system,] user."""
    system = [{"role": "system", "content": problem.system}] if problem.system is not None else []
    return system + [{"role": "user", "content": problem.prompt}]


def render_chat(tokenizer, messages: list[dict[str, str]]) -> str:
    """`messages` in the tokenizer's own chat template, ending where the assistant's answer starts.

    Tokenizers say how through `chat_prompt(messages)` (model/tokenizer.py; model/hf.py's
    HFTokenizer uses the checkpoint's template)."""
    render = getattr(tokenizer, "chat_prompt", None)
    if render is not None:
        return render(messages)
    raise ValueError(f"the tokenizer ({type(tokenizer).__name__}) has no chat template, so a chat task "
                     "cannot be rendered; set task.chat_template: false or use a checkpoint whose tokenizer "
                     "has one")


def encode_prompt(tokenizer, problem: Problem) -> list[int]:
    """The prompt's token ids: a chat problem rendered with the tokenizer's chat template (the
    template writes any BOS itself), else BOS (when the tokenizer's model uses one) + the prompt."""
    if problem.chat:
        return tokenizer.encode(render_chat(tokenizer, chat_messages(problem)))
    bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    return bos + tokenizer.encode(problem.prompt)


__all__ = ["Problem", "TaskSource", "build_task", "chat_messages", "encode_prompt", "render_chat"]
