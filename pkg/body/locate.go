package body

// Locate finds the value at a path of object members in the JSON document b
// without decoding it: b[start:end] is the value's raw JSON, so a caller can
// replace it and keep every other byte. Each name of path is a member of the
// object the previous name led to; as in Python's json, which the engines use,
// the last duplicate of a name counts. ok is false when b is not a valid JSON
// object, or when a name is absent or leads to something other than an object
// before the path ends. With no path it locates the whole document.
func Locate(b []byte, path ...string) (start, end int, ok bool) {
	o, err := Parse(b)
	if err != nil {
		return 0, 0, false
	}
	return o.Locate(path...)
}

// Locate is Locate on a parsed Object: the offsets are into o.Bytes().
func (o *Object) Locate(path ...string) (start, end int, ok bool) {
	start, end = 0, len(o.raw)
	for i, name := range path {
		raw, found := o.Raw(name)
		if !found {
			return 0, 0, false
		}
		// raw is o.raw[vs:ve]: its offset is what it lacks of o.raw's capacity.
		vs := cap(o.raw) - cap(raw)
		start, end = start+vs, start+vs+len(raw)
		if i == len(path)-1 {
			break
		}
		if raw[0] != '{' {
			return 0, 0, false
		}
		// A nested object is parsed on its own; it was validated with the
		// whole, so this only indexes its members.
		inner, err := Parse(raw)
		if err != nil {
			return 0, 0, false
		}
		o = inner
	}
	return start, end, true
}
