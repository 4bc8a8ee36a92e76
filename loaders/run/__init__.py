"""Making a placed model run: execution hooks, streaming from disk, readahead, CPU experts, the multi-GPU schedule."""
