"""The shared-memory data plane: the IO arena (`shared`) and its slot allocator (`slots`)."""
