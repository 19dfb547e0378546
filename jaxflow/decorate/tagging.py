"""Three-level topic tags as integer ids, the default 21-category hierarchy, and hierarchical
accuracy.

DecorateLM (Zhao et al., "Data Engineering through Corpus Rating, Tagging, and Editing with
Language Models", EMNLP 2024) tags every text with a path of three levels whose first level has
21 categories. A tag here is ``(level1, level2, level3)`` ids; every level-2 id has one level-1
parent and every level-3 id one level-2 parent, so a leaf id determines its whole path.

The default tree (``default_hierarchy``) keeps the paper's 21 first-level names; the two
sub-levels (2 children each, 84 leaves) and their keywords are this project's own, small enough
for a keyword annotator and a CPU student. Each leaf carries keywords used by the templated
corpus generator and by the programmatic teacher.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

#: The paper's 21 first-level categories, in its order.
LEVEL1_NAMES = (
    "Natural Sciences", "Humanities and Social Sciences", "Industrial Manufacturing",
    "Medical and Health", "Agriculture and Forestry", "Energy and Mining", "Finance and Real Estate",
    "Education", "Transportation", "Technology and Internet", "Law", "Military",
    "Travel and Tourism", "Entertainment", "Arts and Culture", "Emotional Psychology",
    "Fashion and Beauty", "Sports", "Home and Lifestyle", "Public Administration", "Social Events",
)

# level1 -> ((level2, ((level3, keywords), (level3, keywords))), ...)
_TREE: dict[str, tuple] = {
    "Natural Sciences": (
        ("Physics", (("Mechanics", "force momentum velocity acceleration"),
                     ("Optics", "lens photon refraction wavelength"))),
        ("Biology", (("Genetics", "gene chromosome mutation genome"),
                     ("Ecology", "species habitat ecosystem predator")))),
    "Humanities and Social Sciences": (
        ("History", (("Ancient history", "empire dynasty pharaoh archaeology"),
                     ("Modern history", "revolution treaty industrialization colonial"))),
        ("Sociology", (("Demography", "population census migration fertility"),
                       ("Social theory", "institution class norms stratification")))),
    "Industrial Manufacturing": (
        ("Machinery", (("Machine tools", "lathe milling spindle tolerance"),
                       ("Robotics", "actuator gripper servo manipulator"))),
        ("Materials", (("Metallurgy", "alloy smelting furnace steel"),
                       ("Plastics", "polymer injection molding resin")))),
    "Medical and Health": (
        ("Clinical medicine", (("Cardiology", "heart artery cardiac pulse"),
                               ("Oncology", "tumor chemotherapy biopsy carcinoma"))),
        ("Public health", (("Nutrition", "vitamin protein calorie diet"),
                           ("Epidemiology", "outbreak vaccine infection incidence")))),
    "Agriculture and Forestry": (
        ("Crops", (("Grain farming", "wheat harvest irrigation tillage"),
                   ("Horticulture", "orchard greenhouse seedling pruning"))),
        ("Forestry", (("Timber", "logging sawmill lumber hardwood"),
                      ("Conservation", "reforestation canopy wildfire woodland")))),
    "Energy and Mining": (
        ("Power", (("Renewables", "solar turbine photovoltaic wind"),
                   ("Grid", "transmission transformer voltage substation"))),
        ("Mining", (("Coal", "colliery seam shaft anthracite"),
                    ("Minerals", "ore copper quarry drilling")))),
    "Finance and Real Estate": (
        ("Markets", (("Stocks", "equity dividend shareholder portfolio"),
                     ("Banking", "loan deposit interest credit"))),
        ("Property", (("Housing", "mortgage rent landlord tenant"),
                      ("Commercial property", "lease office zoning developer")))),
    "Education": (
        ("Schools", (("Primary school", "pupil classroom curriculum homework"),
                     ("Higher education", "university lecture thesis semester"))),
        ("Learning", (("Pedagogy", "teacher lesson assessment feedback"),
                      ("Online learning", "course webinar enrollment quiz")))),
    "Transportation": (
        ("Road", (("Cars", "engine sedan highway traffic"),
                  ("Freight", "truck cargo logistics warehouse"))),
        ("Rail and air", (("Railways", "locomotive track station carriage"),
                          ("Aviation", "aircraft runway pilot airline")))),
    "Technology and Internet": (
        ("Software", (("Programming languages", "python function statement expression "
                                                "syntax interpreter module object class "
                                                "variable argument exception method "
                                                "attribute string operator keyword "
                                                "return loop"),
                      ("Databases", "query table index transaction"))),
        ("Networks", (("Web", "browser website server http"),
                      ("Security", "encryption password firewall malware")))),
    "Law": (
        ("Civil law", (("Contracts", "contract breach clause damages"),
                       ("Property law", "deed easement title ownership"))),
        ("Criminal law", (("Courts", "judge jury verdict trial"),
                          ("Policing", "arrest detective evidence warrant")))),
    "Military": (
        ("Armed forces", (("Army", "infantry battalion regiment artillery"),
                          ("Navy", "warship fleet submarine admiral"))),
        ("Strategy", (("Tactics", "flank maneuver reconnaissance ambush"),
                      ("Defense policy", "deterrence alliance budget procurement")))),
    "Travel and Tourism": (
        ("Destinations", (("Beaches", "resort coast snorkeling island"),
                          ("Cities", "museum landmark sightseeing cathedral"))),
        ("Travel services", (("Hotels", "reservation lobby suite concierge"),
                             ("Tours", "itinerary guide excursion backpacking")))),
    "Entertainment": (
        ("Screen", (("Film", "director cinema screenplay actor"),
                    ("Television", "episode series broadcast sitcom"))),
        ("Games", (("Video games", "console player level multiplayer"),
                   ("Board games", "dice chess card tabletop")))),
    "Arts and Culture": (
        ("Visual arts", (("Painting", "canvas brush portrait fresco"),
                         ("Sculpture", "marble statue chisel bronze"))),
        ("Performing arts", (("Music", "melody orchestra symphony chord"),
                             ("Theatre", "stage playwright rehearsal audience")))),
    "Emotional Psychology": (
        ("Emotions", (("Anxiety", "worry fear panic stress"),
                      ("Happiness", "joy gratitude contentment optimism"))),
        ("Relationships", (("Friendship", "trust loyalty companionship support"),
                           ("Family", "parent sibling childhood marriage")))),
    "Fashion and Beauty": (
        ("Clothing", (("Apparel", "dress fabric tailor garment"),
                      ("Footwear", "sneaker heel leather sole"))),
        ("Beauty", (("Cosmetics", "lipstick foundation mascara makeup"),
                    ("Skincare", "moisturizer cleanser serum sunscreen")))),
    "Sports": (
        ("Team sports", (("Football", "goal striker referee league"),
                         ("Basketball", "dribble hoop rebound playoff"))),
        ("Individual sports", (("Running", "marathon sprint pace stamina"),
                               ("Tennis", "racket serve volley tournament")))),
    "Home and Lifestyle": (
        ("Home", (("Cooking", "recipe oven ingredient simmer"),
                  ("Gardening", "soil compost flowerbed watering"))),
        ("Living", (("Interior design", "furniture sofa curtain decor"),
                    ("Pets", "puppy kitten veterinarian leash")))),
    "Public Administration": (
        ("Government", (("Elections", "ballot candidate vote campaign"),
                        ("Taxation", "revenue taxpayer levy deduction"))),
        ("Public services", (("Urban planning", "infrastructure transit housing permit"),
                             ("Welfare", "pension benefit unemployment subsidy")))),
    "Social Events": (
        ("Celebrations", (("Weddings", "bride groom ceremony reception"),
                          ("Festivals", "parade fireworks carnival lantern"))),
        ("Gatherings", (("Conferences", "keynote attendee panel networking"),
                        ("Protests", "march rally petition demonstrators")))),
}


@dataclasses.dataclass(frozen=True)
class TagHierarchy:
    """A three-level tag tree.

    Attributes:
      names: (level-1 names [n1], level-2 names [n2], level-3 names [n3]).
      parent2: [n2] level-1 id of each level-2 tag.
      parent3: [n3] level-2 id of each level-3 tag.
      keywords: [n3] tuple of lower-case keywords per leaf (may be empty).
    """

    names: tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]
    parent2: tuple[int, ...]
    parent3: tuple[int, ...]
    keywords: tuple[tuple[str, ...], ...] = ()

    def __post_init__(self):
        n1, n2, n3 = (len(x) for x in self.names)
        if min(n1, n2, n3) == 0:
            raise ValueError(f"TagHierarchy needs >= 1 tag per level, got sizes {(n1, n2, n3)}")
        if len(self.parent2) != n2 or len(self.parent3) != n3:
            raise ValueError(f"parent2 has {len(self.parent2)} entries for {n2} level-2 tags and "
                             f"parent3 {len(self.parent3)} for {n3} level-3 tags")
        if not all(0 <= p < n1 for p in self.parent2):
            raise ValueError(f"parent2 ids must be in [0, {n1}), got {self.parent2}")
        if not all(0 <= p < n2 for p in self.parent3):
            raise ValueError(f"parent3 ids must be in [0, {n2}), got {self.parent3}")
        if self.keywords and len(self.keywords) != n3:
            raise ValueError(f"keywords has {len(self.keywords)} entries for {n3} leaves")

    @property
    def sizes(self) -> tuple[int, int, int]:
        """The number of tags at each of the three levels."""
        return tuple(len(x) for x in self.names)  # type: ignore[return-value]

    def path(self, leaf: int) -> tuple[int, int, int]:
        """(level1, level2, level3) ids of leaf ``leaf``."""
        l2 = self.parent3[leaf]
        return self.parent2[l2], l2, leaf

    def paths(self, leaves: np.ndarray) -> np.ndarray:
        """[N] leaf ids -> [N, 3] int32 tag paths."""
        leaves = np.asarray(leaves, np.int64)
        l2 = np.asarray(self.parent3)[leaves]
        return np.stack([np.asarray(self.parent2)[l2], l2, leaves], axis=1).astype(np.int32)

    def name(self, tag: Sequence[int]) -> str:
        """'level1 > level2 > level3' for a tag path."""
        return " > ".join(self.names[i][int(t)] for i, t in enumerate(tag))


def default_hierarchy() -> TagHierarchy:
    """The 21-category tree: 21 level-1, 42 level-2, 84 level-3 tags with keywords."""
    n1, n2, n3, p2, p3, kws = [], [], [], [], [], []
    for a, name1 in enumerate(LEVEL1_NAMES):
        n1.append(name1)
        for name2, leaves in _TREE[name1]:
            p2.append(a)
            b = len(n2)
            n2.append(name2)
            for name3, words in leaves:
                p3.append(b)
                n3.append(name3)
                kws.append(tuple(words.split()))
    return TagHierarchy((tuple(n1), tuple(n2), tuple(n3)), tuple(p2), tuple(p3), tuple(kws))


def validate_tags(tags: np.ndarray, hierarchy: TagHierarchy) -> np.ndarray:
    """Checks [N, 3] tag paths against the tree; returns them as int32.

    Raises:
      ValueError: naming the first row whose id is out of range or whose levels are not a
        parent-child path of ``hierarchy``.
    """
    tags = np.asarray(tags)
    if tags.ndim != 2 or tags.shape[1] != 3:
        raise ValueError(f"tags must have shape [N, 3] (level1, level2, level3), got {tags.shape}")
    sizes = hierarchy.sizes
    for level in range(3):
        bad = np.flatnonzero((tags[:, level] < 0) | (tags[:, level] >= sizes[level]))
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"tag row {i} {tags[i].tolist()}: level-{level + 1} id "
                             f"{int(tags[i, level])} is outside the hierarchy (valid 0..{sizes[level] - 1})")
    expect = hierarchy.paths(tags[:, 2])
    bad = np.flatnonzero((expect != tags).any(axis=1))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"tag row {i} {tags[i].tolist()} is not a path of the hierarchy; leaf "
                         f"{int(tags[i, 2])} belongs to {expect[i].tolist()}")
    return tags.astype(np.int32)


def hierarchical_decode(logp1, logp2, logp3, hierarchy: TagHierarchy):
    """The most likely consistent path from per-level log-probabilities.

    Args:
      logp1, logp2, logp3: [N, n1], [N, n2], [N, n3] log-probabilities (numpy or jax).

    Returns:
      [N, 3] int32 paths maximising logp1[a] + logp2[b] + logp3[c] over paths (a, b, c).
    """
    import jax.numpy as jnp

    p3 = jnp.asarray(hierarchy.parent3)
    p2 = jnp.asarray(hierarchy.parent2)
    leaf_score = logp3 + logp2[:, p3] + logp1[:, p2[p3]]
    leaf = jnp.argmax(leaf_score, axis=-1)
    l2 = p3[leaf]
    return jnp.stack([p2[l2], l2, leaf], axis=-1).astype(jnp.int32)


def hierarchical_accuracy(pred: np.ndarray, true: np.ndarray) -> dict[str, float]:
    """Per-level accuracy and path accuracy (all levels up to that one correct).

    Args:
      pred, true: [N, 3] tag paths.

    Returns:
      {"level1", "level2", "level3", "path2", "path3"} in [0, 1]; "path3" is exact match.
    """
    pred, true = np.asarray(pred), np.asarray(true)
    if pred.shape != true.shape or pred.ndim != 2 or pred.shape[1] != 3:
        raise ValueError(f"pred {pred.shape} and true {true.shape} must both be [N, 3]")
    if pred.shape[0] == 0:
        raise ValueError("hierarchical_accuracy needs at least one row")
    eq = pred == true
    return {"level1": float(eq[:, 0].mean()), "level2": float(eq[:, 1].mean()),
            "level3": float(eq[:, 2].mean()), "path2": float(eq[:, :2].all(1).mean()),
            "path3": float(eq.all(1).mean())}
