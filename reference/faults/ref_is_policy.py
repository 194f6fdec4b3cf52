"""ref_is_policy (RLG008): the KL reference is the live policy object, so the KL term is always 0."""


def make_reference(model):
    ref_model = model
    return ref_model
