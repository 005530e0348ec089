"""The service around the engine core: wire protocol, server loop, clients, launcher, addresses, stats.

Nothing here is needed to run the engine in process (`engine.LLM`); the client side (protocol,
client, launcher, addresses) imports no torch.
"""
