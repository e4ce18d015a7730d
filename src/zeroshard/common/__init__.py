"""What every floor uses: guarded transitions between the states of an Enum (`move`, which
raises StateError naming both states on a transition the owner's table does not allow) and
temporary modes for the length of a block (`temporarily`).

May import: nothing of zeroshard (it is the floor beneath the others).
"""
