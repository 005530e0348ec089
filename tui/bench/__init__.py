"""`minichat bench`: a serving benchmark over the engine's ZeroMQ protocol, with a transformers baseline."""
