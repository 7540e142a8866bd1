"""What every adapter and drafter shares on the device: CUDA graphs (``graphs``) and host/device copies that do not
stall the host (``transfer``)."""
