"""The way of one generation request: the service that wires it, its run (the I/O loop), its
record and the one writer of its outcome, the policy it obeys, its body parsed off the loop,
and the routes relayed as the upstream answers them.
"""
