"""HTTP front ends: routed decoding (app.py, OpenAI API) and the tokenize service; imported on use."""
