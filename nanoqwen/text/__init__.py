"""Text in and out: the model's tokenizer and chat template, and streaming text back.

Read `tokenizer.py` (prompts to ids, conversations through the chat template, the
checkpoint's end-of-sequence ids and sampling defaults), then `detokenizer.py` (ids back
to text a stream can send: never half a character, never part of a stop string), and
`stop_strings.py` (finding the first of many stop strings, a character at a time).
"""
