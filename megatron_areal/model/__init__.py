"""What a supported model is, independent of who runs it: the architecture facts read from an HF
config (``arch``), the HF <-> Megatron parameter mapping (``mapping``), HF folders on disk
(``hf_io``) and into a live Megatron model (``weights``), RoPE frequencies (``rope``), parameter
and FLOP counts (``counts``) and the published models known by name (``catalogue``).

The actor, the server, conversion, weight transfer, the launcher's checks and the simulator all
read these modules; this package imports none of them.
"""
