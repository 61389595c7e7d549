"""A real byte-level BPE tokenizer trained here with `tokenizers`, wrapped as a transformers
PreTrainedTokenizerFast with a ChatML chat template (the Qwen family's format), for tests of the
chat-template rendering and the token-in / token-out turns. No stub: the rendering is transformers'
own `apply_chat_template`."""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "What is 2 + 3? The answer is \\boxed{5}.",
    "Natalia sold 48 clips in April and half as many in May. #### 72",
    "user assistant tool system result: 7 calculator",
] * 4


def build_chat_tokenizer(chat_template: str | None = CHATML) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    hf.chat_template = chat_template
    return hf
