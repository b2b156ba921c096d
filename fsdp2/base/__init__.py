"""The floor every layer stands on: the policies users pass (and how each
boolean argument is read), the markers fsdp2 puts on parameters, the device
seam (``DeviceOps``), the logger and the version, torch's own FSDP
recognised, and the only two files that reach into torch's private APIs
(private_api.py, private_dist.py). Imports nothing of fsdp2's."""
