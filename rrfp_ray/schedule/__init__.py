"""Schedule IR: actions, the layout of virtual stages and their links, schedule generators, validation."""
