"""Text in and out: the model's tokenizer, and streaming text back.

Read `tokenizer.py` (prompts to ids, the chat template, the checkpoint's end-of-sequence
ids and sampling defaults, and the streaming detokenizer: never half a character, never
part of a stop string), `stop_strings.py` (finding the first of many stop strings, a
character at a time) `chat_template.py` (the system prompt a template writes by itself) and
`generation_config.py` (the checkpoint's end-of-sequence ids and sampling settings).
"""
