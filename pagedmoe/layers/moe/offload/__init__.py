"""Expert offloading: the routed experts of an MoE model kept in their safetensors files and read on demand
into a fixed pool of slots per layer (an expert cache with LRU or LFU eviction), with the next layer's experts
predicted from its router and read ahead on a background thread."""
