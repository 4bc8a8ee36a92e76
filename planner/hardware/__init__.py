"""The devices a plan may use: device ids, byte units, detection (cgroups, GPUs), the calibration record."""
