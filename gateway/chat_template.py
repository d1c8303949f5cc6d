"""Chat messages -> one prompt string, with the checkpoint's own chat template.

Where the template comes from, in order:
1. the checkpoint's tokenizer (`chat_template` in tokenizer_config.json, or chat_template.jinja),
   rendered by transformers' `apply_chat_template` (jinja2, sandboxed) when the tokenizer loads;
2. the same template rendered with jinja2 directly, when it is there but no tokenizer loads;
3. otherwise (the `tiny` model, checkpoints without a template) the documented simple template,
   ChatML written as plain text, the format Qwen models use:

       <|im_start|>system
       You are terse.<|im_end|>
       <|im_start|>user
       Hi<|im_end|>
       <|im_start|>assistant
       (the model's answer starts here)

The rendered text is sent as the prompt; the metadata service tokenizes it with the same
checkpoint's tokenizer, so the template's special tokens become their ids there."""
from __future__ import annotations

import json
import os

SIMPLE_TEMPLATE = "simple (ChatML as plain text)"


def render_simple(messages: list[dict], add_generation_prompt: bool = True) -> str:
    out = [f"<|im_start|>{m['role']}\n{m.get('content') or ''}<|im_end|>\n" for m in messages]
    if add_generation_prompt:
        out.append("<|im_start|>assistant\n")
    return "".join(out)


def _template_in(path: str) -> str | None:
    """The chat template a checkpoint directory ships, as transformers would find it."""
    jinja = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(jinja):
        with open(jinja) as f:
            return f.read()
    for name in ("chat_template.json", "tokenizer_config.json"):
        p = os.path.join(path, name)
        if os.path.isfile(p):
            try:
                with open(p) as f:
                    t = json.load(f).get("chat_template")
            except (OSError, ValueError):
                continue
            if isinstance(t, list):  # named templates: [{"name": "default", "template": ...}, ...]
                t = next((x.get("template") for x in t if x.get("name") == "default"), None)
            if isinstance(t, str) and t:
                return t
    return None


class ChatTemplate:
    """`render(messages)` -> prompt text. `source` says which template is used (for /v1/models and
    the logs)."""

    def __init__(self, model: str | None):
        self._tokenizer = None
        self._jinja = None
        self.source = SIMPLE_TEMPLATE
        self.thinks = False  # the template knows Qwen3's <think> (the reasoning parser applies)
        self.knows_developer = True   # a template that never names the role drops such messages
        if not model or model == "tiny" or not os.path.isdir(model):
            return
        template = _template_in(model)
        if template is None:
            return
        self.thinks = "<think>" in template
        self.knows_developer = "developer" in template
        try:
            from transformers import AutoTokenizer
            tok = AutoTokenizer.from_pretrained(model)
            if getattr(tok, "chat_template", None):
                self._tokenizer, self.source = tok, f"{model} (tokenizer's chat_template)"
                return
        except Exception:  # noqa: BLE001 - no loadable tokenizer: render the template ourselves
            pass
        self._jinja, self.source = self._compile(template, model), f"{model} (chat_template via jinja2)"

    @staticmethod
    def _compile(template: str, model: str):
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise ValueError(message)
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False, indent=indent)
        compiled = env.from_string(template)
        special = {}
        try:
            with open(os.path.join(model, "tokenizer_config.json")) as f:
                cfg = json.load(f)
            for k in ("bos_token", "eos_token"):
                v = cfg.get(k)
                special[k] = v.get("content", "") if isinstance(v, dict) else (v or "")
        except (OSError, ValueError):
            pass
        return lambda **kw: compiled.render(**special, **kw)

    def render(self, messages: list[dict], add_generation_prompt: bool = True, continue_final: bool = False,
               **template_kwargs) -> str:
        """Raises ValueError when the template refuses the conversation (e.g. roles out of order).
        continue_final (vLLM's continue_final_message): the text ends where the last message's
        content does, open for the model to go on (transformers' rule). A `developer` message is a
        `system` one for a template that does not name the role (Qwen3's would drop it), as vLLM
        renders it."""
        if not self.knows_developer:
            messages = [dict(m, role="system") if m.get("role") == "developer" else m for m in messages]
        if self._tokenizer is not None:
            try:
                return self._tokenizer.apply_chat_template(messages, tokenize=False,
                                                           add_generation_prompt=add_generation_prompt,
                                                           continue_final_message=continue_final,
                                                           **template_kwargs)
            except Exception as e:  # noqa: BLE001 - jinja errors, raise_exception(...) in templates
                raise ValueError(f"the chat template refused these messages: {e}") from None
        if self._jinja is not None:
            try:
                text = self._jinja(messages=messages, add_generation_prompt=add_generation_prompt,
                                   **template_kwargs)
            except Exception as e:  # noqa: BLE001
                raise ValueError(f"the chat template refused these messages: {e}") from None
        else:
            text = render_simple(messages, add_generation_prompt)
        return _continued(text, messages) if continue_final else text


def _continued(text: str, messages: list[dict]) -> str:
    """The rendered conversation cut right after the last message's content (as transformers'
    continue_final_message cuts it)."""
    final = str(messages[-1].get("content") or "") if messages else ""
    for needle in (final, final.strip()):
        if needle and needle in text:
            return text[:text.rindex(needle) + len(needle)]
    raise ValueError("continue_final_message: the last message's content is not in the rendered chat")
