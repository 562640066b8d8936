package body

// Edits inside nested objects: some engine APIs take the fields a router
// sets one object down or more (vLLM's token-in generate reads the KV
// handoff from sampling_params.extra_args). Such an edit rewrites the one
// top-level member it reaches into: that member's value is spliced like a
// body of its own and the member is then set to the result, so everything
// else in the body keeps its bytes and only the small nested object is copied.
//
// The rules, which FuzzApply checks against encoding/json:
//   - For each member (its path and key) the last edit naming it wins.
//   - Edits apply from the outside in: an edit of a member first, then the
//     edits inside it, which see its new value. IfPresent and Delete look at
//     the object as the outer edits left it.
//   - A set creates the objects on its path that are absent, and replaces
//     those that are not objects; a delete or a set-if-present whose path
//     is not all objects changes nothing.
//   - An object reached into is read as the engines read it: the last
//     duplicate. When it changes, the member is set (so its other
//     duplicates go, as with any set); when nothing in it changes, the body
//     keeps it as it was.

// In returns the edit applied inside the object at path (outermost first):
// Set("kv_transfer_params", v).In("sampling_params", "extra_args") sets
// sampling_params.extra_args.kv_transfer_params.
func (e Edit) In(path ...string) Edit {
	e.Path = path
	return e
}

// reachesIn reports whether an edit inside an object may change the body: a
// set creates its path, but a delete or a set-if-present changes nothing
// unless the path's first member is there, in the body or set beside it. The
// scrub of vLLM's vllm_xargs.kv_transfer_params, on every leg, rarely is.
func (o *Object) reachesIn(edits []Edit) bool {
	for _, e := range edits {
		if len(e.Path) > 0 && (len(e.Value) > 0 && !e.IfPresent || o.Has(e.Path[0]) || names(edits, e.Path[0])) {
			return true
		}
	}
	return false
}

// names reports whether a top-level edit names key.
func names(edits []Edit, key string) bool {
	for _, e := range edits {
		if len(e.Path) == 0 && e.Key == key {
			return true
		}
	}
	return false
}

// emptyObject is what a set reaches into when its path is absent or not an
// object.
var emptyObject = func() *Object {
	o, err := Parse([]byte("{}"))
	if err != nil {
		panic(err)
	}
	return o
}()

// flatten turns the edits into edits of top-level members only: those that
// reach into a member become a set of that member, in the place its first
// edit had among the others (where a new member is appended follows it).
func (o *Object) flatten(edits []Edit) []Edit {
	type group struct {
		key   string
		at    int    // its place in out
		inner []Edit // the edits inside the member, one level down
	}
	out := make([]Edit, 0, len(edits))
	var holder []bool // out[i] is a group's placeholder
	var groups []group
	for _, e := range edits {
		if len(e.Path) == 0 {
			out, holder = append(out, e), append(holder, false)
			continue
		}
		key := e.Path[0]
		e.Path = e.Path[1:]
		k := 0
		for k < len(groups) && groups[k].key != key {
			k++
		}
		if k == len(groups) {
			groups = append(groups, group{key: key, at: len(out)})
			out, holder = append(out, Edit{}), append(holder, true) // filled in or dropped below
		}
		groups[k].inner = append(groups[k].inner, e)
	}
	drop := make([]bool, len(out))
	for _, g := range groups {
		base, present := o.reached(out, holder, g.key)
		v, changed := spliceInto(base, present, g.inner)
		if !changed {
			drop[g.at] = true // the member's own edits, if any, stay in force
			continue
		}
		// The inner edits saw the member's own edits: the result outranks them.
		for i, e := range out {
			if i == g.at || !holder[i] && e.Key == g.key {
				out[i] = Set(g.key, v)
			}
		}
	}
	kept := out[:0]
	for i, e := range out {
		if !drop[i] {
			kept = append(kept, e)
		}
	}
	return kept
}

// reached is the value the edits inside key apply to: that of the last
// top-level edit of key in out, or else the client's.
func (o *Object) reached(out []Edit, holder []bool, key string) (value []byte, present bool) {
	for i := len(out) - 1; i >= 0; i-- {
		e := out[i]
		if holder[i] || e.Key != key {
			continue
		}
		if len(e.Value) == 0 || e.IfPresent && !o.Has(key) {
			return nil, false
		}
		return e.Value, true
	}
	return o.Raw(key)
}

// spliceInto applies edits inside the value base (present or not) and
// returns the new value, or changed false when the value stays as it is.
func spliceInto(base []byte, present bool, edits []Edit) (value []byte, changed bool) {
	var sub *Object
	if present {
		sub, _ = Parse(base) // nil when base is not an object
	}
	if sub == nil {
		out := emptyObject.Splice(edits...)
		if out.Len() == len(emptyObject.raw) {
			return nil, false // nothing was set: the path stays as it is
		}
		return out.Bytes(), true
	}
	out := sub.Splice(edits...)
	if len(out) == 1 && len(out[0]) == len(base) && &out[0][0] == &sub.raw[0] {
		return nil, false
	}
	return out.Bytes(), true
}
