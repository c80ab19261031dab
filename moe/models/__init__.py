"""The published architectures, block parts: rotary embeddings (:mod:`.rope`), DeepSeek-V3's multi-head latent
attention (:mod:`.mla`)."""
