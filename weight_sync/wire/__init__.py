"""What travels, and its pure planning: the typed metadata of a push, the plan of its buckets,
packing, the blocks a sharded trainer's ranks send, name mapping, checksums and the version
rules. Nothing here moves a byte or holds a process group."""
