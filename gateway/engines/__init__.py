"""Weight sync for inference engines (docs/weight-sync.md): the hold that keeps new calls
in the gateway while the engines are paused (``hold``), the client of vLLM's dev RL API
(``control``), and the fleet the admin API pauses and resumes (``fleet``)."""
