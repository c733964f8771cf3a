"""The discrete-event simulator: thousands of real protocol cores on a virtual clock."""

# Importing torchpass_p2p first runs its guards for the compiled build, which cover sims too.
import torchpass_p2p  # noqa: F401
