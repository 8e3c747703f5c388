"""The suite: a package, so pytest imports each module once, under the name (tests.x) its neighbours import it by."""
