"""Reference inference engines behind the `InstanceAdaptor` contract.

`HFEngine` (transformers, imports torch) lives in `tensorcast.engine.hf`; the HTTP front end in
`tensorcast.engine.server` imports neither, so a client can drive an engine without torch.
"""
