"""One model across hosts: one stage per torch.distributed rank, one wire protocol, rank 0's HTTP front."""
