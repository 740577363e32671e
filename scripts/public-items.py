#!/usr/bin/env python3
"""Counts the library's public API from rustdoc's JSON: every name a user can reach from the
crate root (modules, types, traits, functions, constants, statics, macros, re-exports), and,
separately, their public members (fields, variants, inherent methods and constants).

A name reachable under several paths is counted once per path, since each path is API. Items
marked `#[doc(hidden)]` and everything under them are left out. Run by scripts/public-items.sh.
"""
import json
import sys


def main(path):
    d = json.load(open(path))
    index = d["index"]

    def item(i):
        return index.get(str(i)) if isinstance(i, int) else index.get(i)

    def hidden(it):
        for a in it.get("attrs", []):
            text = a if isinstance(a, str) else json.dumps(a)
            if "doc(hidden)" in text.replace(" ", "") or '"hidden"' in text:
                return True
        return False

    names = {}  # path -> kind
    members = 0
    seen_members = set()

    def count_members(it):
        nonlocal members
        if it["id"] in seen_members:
            return
        seen_members.add(it["id"])
        kind, inner = next(iter(it["inner"].items()))
        ids = []
        if kind == "struct":
            k = inner["kind"]
            if isinstance(k, dict) and "plain" in k:
                ids += k["plain"]["fields"]
            elif isinstance(k, dict) and "tuple" in k:
                ids += [f for f in k["tuple"] if f is not None]
            ids_impls = inner.get("impls", [])
        elif kind == "enum":
            ids += inner["variants"]
            ids_impls = inner.get("impls", [])
        elif kind == "union":
            ids += inner["fields"]
            ids_impls = inner.get("impls", [])
        elif kind == "trait":
            ids += inner["items"]
            ids_impls = []
        else:
            ids_impls = []
        for i in ids:
            m = item(i)
            if m and not hidden(m) and (m["visibility"] == "public" or kind in ("enum", "trait")):
                members += 1
        for i in ids_impls:
            im = item(i)
            if not im:
                continue
            imp = im["inner"].get("impl", {})
            if imp.get("trait") is not None or imp.get("is_synthetic") or imp.get("blanket_impl"):
                continue
            for j in imp.get("items", []):
                m = item(j)
                if m and m["visibility"] == "public" and not hidden(m):
                    members += 1

    def walk(mod_id, prefix, stack):
        m = item(mod_id)
        for i in m["inner"]["module"]["items"]:
            it = item(i)
            if it is None or it["crate_id"] != 0 or hidden(it):
                continue
            if it["visibility"] != "public":
                continue
            kind, inner = next(iter(it["inner"].items()))
            if kind == "use":
                target = item(inner["id"]) if inner.get("id") is not None else None
                if target is None or target["crate_id"] != 0:
                    names[f"{prefix}::{inner['name']}"] = "re-export"
                    continue
                tkind = next(iter(target["inner"]))
                if inner.get("is_glob"):
                    if tkind == "module" and target["id"] not in stack:
                        walk(target["id"], prefix, stack | {target["id"]})
                    continue
                name = inner["name"]
                names[f"{prefix}::{name}"] = tkind
                if tkind == "module" and target["id"] not in stack:
                    walk(target["id"], f"{prefix}::{name}", stack | {target["id"]})
                else:
                    count_members(target)
                continue
            if kind == "impl":
                continue
            names[f"{prefix}::{it['name']}"] = kind
            if kind == "module":
                walk(it["id"], f"{prefix}::{it['name']}", stack | {it["id"]})
            else:
                count_members(it)

    walk(d["root"], "actorpipe", {d["root"]})
    if "-v" in sys.argv:
        for p in sorted(names):
            print(f"{names[p]:<22} {p}")
    print(f"{len(names)} public names, {members} public members (fields, variants, methods)")


if __name__ == "__main__":
    main(sys.argv[1])
