package body

import "testing"

func TestNestedEditsWriteExactBytes(t *testing.T) {
	kv := []byte(`{"do_remote_decode":true}`)
	tests := []struct {
		name  string
		in    string
		edits []Edit
		want  string
	}{
		{
			name:  "set creates the objects on its path",
			in:    `{"token_ids":[1,2]}`,
			edits: []Edit{Set("kv_transfer_params", kv).In("sampling_params", "extra_args")},
			want:  `{"token_ids":[1,2],"sampling_params":{"extra_args":{"kv_transfer_params":{"do_remote_decode":true}}}}`,
		},
		{
			name:  "set inside an existing object keeps its other bytes",
			in:    `{"sampling_params": { "temperature" : 0.5, "extra_args": {"x": 1} }, "stream": true}`,
			edits: []Edit{Set("kv_transfer_params", kv).In("sampling_params", "extra_args")},
			want:  `{"sampling_params": { "temperature" : 0.5, "extra_args": {"x": 1,"kv_transfer_params":{"do_remote_decode":true}} }, "stream": true}`,
		},
		{
			name:  "set replaces a path member that is not an object",
			in:    `{"sampling_params":{"extra_args":null}}`,
			edits: []Edit{Set("kv_transfer_params", kv).In("sampling_params", "extra_args")},
			want:  `{"sampling_params":{"extra_args":{"kv_transfer_params":{"do_remote_decode":true}}}}`,
		},
		{
			name: "edits of one object are spliced together",
			in:   `{"sampling_params":{"max_tokens":64,"min_tokens":8,"n":1},"token_ids":[1]}`,
			edits: []Edit{
				Set("max_tokens", One).In("sampling_params"), Delete("min_tokens").In("sampling_params"),
				Set("kv_transfer_params", kv).In("sampling_params", "extra_args"),
			},
			want: `{"sampling_params":{"max_tokens":1,"n":1,"extra_args":{"kv_transfer_params":{"do_remote_decode":true}}},"token_ids":[1]}`,
		},
		{
			name:  "delete removes every duplicate inside the object engines read",
			in:    `{"p":{"k":1,"a":0,"k":2}}`,
			edits: []Edit{Delete("k").In("p")},
			want:  `{"p":{"a":0}}`,
		},
		{
			name:  "an object reached into is its last duplicate, and the others go",
			in:    `{"p":{"k":"early"},"a":0,"p":{"k":"late","b":1}}`,
			edits: []Edit{Delete("k").In("p")},
			want:  `{"p":{"b":1},"a":0}`,
		},
		{
			name:  "delete through a path that is not all objects changes nothing",
			in:    `{"p":[{"k":1}],"q":"k"}`,
			edits: []Edit{Delete("k").In("p"), Delete("k").In("q", "r"), SetIfPresent("k", One).In("p")},
			want:  `{"p":[{"k":1}],"q":"k"}`,
		},
		{
			name:  "an edit of the member comes first, the edits inside it see its new value",
			in:    `{"p":{"a":1}}`,
			edits: []Edit{SetIfPresent("z", One).In("p"), Set("p", []byte(`{"z":0}`))},
			want:  `{"p":{"z":1}}`,
		},
		{
			name:  "a set inside a deleted member makes it again",
			in:    `{"p":{"a":1},"q":0}`,
			edits: []Edit{Delete("p"), Set("b", One).In("p")},
			want:  `{"p":{"b":1},"q":0}`,
		},
		{
			name:  "a nested key that needs escapes",
			in:    `{}`,
			edits: []Edit{Set("k\"", One).In("a\\b")},
			want:  `{"a\\b":{"k\"":1}}`,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			o := mustParse(t, tt.in)
			if got := o.Splice(tt.edits...).Bytes(); string(got) != tt.want {
				t.Fatalf("Splice =\n%s\nwant\n%s", got, tt.want)
			}
			if string(o.Bytes()) != tt.in {
				t.Fatalf("Splice changed the input to %s", o.Bytes())
			}
		})
	}

	t.Run("nothing to change inside: the body is not copied", func(t *testing.T) {
		in := []byte(`{"sampling_params":{"max_tokens":4},"vllm_xargs":null}`)
		o, err := Parse(in)
		if err != nil {
			t.Fatal(err)
		}
		got := o.Splice(Delete("kv_transfer_params").In("sampling_params", "extra_args"), Delete("kv_transfer_params").In("vllm_xargs")).Bytes()
		if len(got) != len(in) || &got[0] != &in[0] {
			t.Fatalf("Splice = %s, a copy; want the input itself", got)
		}
	})
}

func TestObjectAndBool(t *testing.T) {
	o := mustParse(t, `{"s":{"n":2},"s":{"n":3},"a":[1],"t":true,"f":false,"x":"true"}`)
	if sub, ok := o.Object("s"); !ok {
		t.Fatal("Object(s) not found")
	} else if n, _ := sub.Int("n"); n != 3 {
		t.Errorf("Object(s).Int(n) = %d, want the last duplicate's 3", n)
	}
	for _, k := range []string{"a", "t", "missing"} {
		if _, ok := o.Object(k); ok {
			t.Errorf("Object(%q) found an object", k)
		}
	}
	for k, want := range map[string][2]bool{"t": {true, true}, "f": {false, true}, "x": {false, false}, "missing": {false, false}} {
		if v, ok := o.Bool(k); v != want[0] || ok != want[1] {
			t.Errorf("Bool(%q) = %v, %v; want %v, %v", k, v, ok, want[0], want[1])
		}
	}
}
